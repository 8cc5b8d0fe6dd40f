"""Talker inputs built incrementally from the thinker's stream, exactly as transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` builds them in one shot.

Fed with thinker *input rows* in order (prompt rows, then each generated token when it is fed back):
token id, its thinker input embedding, and its hidden state after ``accept_hidden_layer`` layers. The last
token the thinker samples is never fed back, so it is never spoken (HF does the same: its hidden states
only cover fed tokens; normally that token is the EOS).

Talker prefill (length L = user rows + 9):
- every prompt row whose role (the token after the nearest ``<|im_start|>`` before it) is ``user``:
  text rows -> ``text_projection(input embedding)``; audio/image/video rows -> ``hidden_projection(hidden)``;
- 9 assistant rows, from the last ``<|im_start|>assistant``: A0..A3 are its first 4 thinker rows projected
  (im_start, "assistant", newline, first text token), P/B/E the projected tts_pad/tts_bos/tts_eos embeds:
      text   A0 A1 A2 P        P            P            P        B        A3
      codec  0  0  0  nothink  think_bos    think_eos    speaker  pad      bos
Positions are 0..L-1 in all three M-RoPE rows (text/audio only: no vision grids), decode step k sits at L+k.
Trailing text (added to talker decode step k's codec embedding): projected assistant rows 4, 5, ...; then
tts_eos once the thinker has finished; then tts_pad forever.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omni_triton.engine.handoff import to_device_async
from omni_triton.models.config import OmniConfig
from omni_triton.pipeline.talker_prompt import ASSISTANT_PREFILL_ROWS, assistant_start, user_row_mask

ASSISTANT_TEXT_ROWS = 4  # im_start, "assistant", newline, first text token


class TalkerInputs:
    """Per-request state turning thinker rows into the talker prefill and trailing text embeddings.

    ``tts_token_embeds`` are the thinker input embeddings of [tts_bos, tts_eos, tts_pad] ([3, thinker hidden]),
    e.g. ``thinker.embed(ids)`` or ``weights.load_thinker_embedding_rows``.
    """

    def __init__(self, talker, config: OmniConfig, prompt_ids: Sequence[int], speaker: str,
                 tts_token_embeds: torch.Tensor):
        self.talker, self.config = talker, config
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.speaker_codec_id = config.speaker_codec_id(speaker)
        self.assistant_start = assistant_start(self.prompt_ids, config)
        self.tts_bos, self.tts_eos, self.tts_pad = talker.project_text(tts_token_embeds).unbind(0)
        self._multimodal_ids = {config.thinker.audio_token_id, config.thinker.image_token_id,
                                config.thinker.video_token_id}
        self._prompt_rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._rows_fed = 0
        self._user_embeds: torch.Tensor | None = None
        self._assistant: list[torch.Tensor] = []  # projected assistant rows, one [H] each
        self._prefill_taken = False
        self._trailing_taken = 0
        self.finished = False  # the thinker will feed no more rows

    # ---- input side
    def feed(self, token_ids: torch.Tensor, input_embeds: torch.Tensor,
             accept_hidden: torch.Tensor | None = None, projected_text: torch.Tensor | None = None) -> None:
        """Next thinker input rows (ids [N], input embeds [N, Ht], accept-layer hidden [N, Ht]).

        ``accept_hidden`` is only needed for prompt rows that hold audio/image/video placeholders.
        ``projected_text`` [N, H]: ``talker.project_text(input_embeds)``, made already by the caller (the served
        talker launches it on Triton's thread, not on the engine thread that feeds a running request)."""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        n = token_ids.shape[0]
        if n == 0:
            return
        first, prompt_len = self._rows_fed, len(self.prompt_ids)
        self._rows_fed += n
        if first < prompt_len:
            take = min(n, prompt_len - first)
            self._prompt_rows.append((token_ids[:take], input_embeds[:take],
                                      None if accept_hidden is None else accept_hidden[:take]))
            if self._rows_fed >= prompt_len:
                self._user_embeds = self._project_user_rows()
        start = max(self.assistant_start - first, 0)
        if start < n:
            projected = (self.talker.project_text(input_embeds[start:]) if projected_text is None
                         else projected_text[start:])
            self._assistant.extend(projected.unbind(0))

    def finish(self) -> None:
        """The thinker is done: after the remaining rows, trailing text is tts_eos, then tts_pad."""
        self.finished = True

    def kept_tensors(self) -> list[torch.Tensor]:
        """The device tensors this keeps for the talker's steps (the projected tts rows, the assistant rows): what
        a caller that builds these inputs on a stream of its own hands over to the engine's stream."""
        return [self.tts_bos, self.tts_eos, self.tts_pad, *self._assistant]

    # ---- output side
    @property
    def prefill_ready(self) -> bool:
        return self._user_embeds is not None and len(self._assistant) >= ASSISTANT_TEXT_ROWS

    @property
    def nothing_to_speak(self) -> bool:
        """The thinker finished before its first text token was fed back (it emitted EOS at once)."""
        return self.finished and not self.prefill_ready

    def take_prefill(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds [L, H], positions [3, L]); call once, when ``prefill_ready``."""
        if not self.prefill_ready:
            raise RuntimeError("talker prefill needs the whole prompt and the first generated token "
                               f"(have {self._rows_fed} of {len(self.prompt_ids) + 1} thinker rows)")
        if self._prefill_taken:
            raise RuntimeError("take_prefill() called twice")
        self._prefill_taken = True
        cfg, talker = self.config.talker, self.talker
        a = self._assistant
        text = torch.stack([a[0], a[1], a[2], self.tts_pad, self.tts_pad, self.tts_pad, self.tts_pad,
                            self.tts_bos, a[3]])
        codec_ids = to_device_async(torch.tensor([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id,
                                                  self.speaker_codec_id, cfg.codec_pad_id, cfg.codec_bos_id]),
                                    text.device)
        codec = torch.cat((text.new_zeros(3, text.shape[1]), talker.embed_codec(codec_ids)))
        embeds = torch.cat((self._user_embeds, text + codec))
        positions = torch.arange(embeds.shape[0], device=embeds.device)[None].expand(3, -1).contiguous()
        return embeds, positions

    @property
    def prefill_length(self) -> int:
        return self._user_embeds.shape[0] + ASSISTANT_PREFILL_ROWS

    def trailing_available(self) -> bool:
        return self.finished or self._trailing_taken + ASSISTANT_TEXT_ROWS < len(self._assistant)

    def next_trailing(self) -> torch.Tensor | None:
        """Trailing text embedding [H] for the next talker decode step, or None while waiting for the thinker."""
        embed = self.peek_trailing()
        if embed is not None:
            self._trailing_taken += 1
        return embed

    def peek_trailing(self) -> torch.Tensor | None:
        """What ``next_trailing`` would return now, without taking it."""
        index = self._trailing_taken + ASSISTANT_TEXT_ROWS
        if index < len(self._assistant):
            return self._assistant[index]
        if not self.finished:
            return None
        return self.tts_eos if index == len(self._assistant) else self.tts_pad

    # ---- internals
    def _project_user_rows(self) -> torch.Tensor:
        # Project every prompt row (as HF does) and keep the user ones: same matmul shapes, same numbers. Which
        # rows are which comes from the prompt ids on the host (the prompt rows' ids are the prompt's): nothing
        # here reads the device, which would wait for every talker step queued on the stream.
        embeds = torch.cat([r[1] for r in self._prompt_rows])
        device = embeds.device
        multimodal = [t in self._multimodal_ids for t in self.prompt_ids]
        text_rows = [row for row, is_multimodal in enumerate(multimodal) if not is_multimodal]
        projected = embeds.new_empty(embeds.shape[0], self.talker.hidden_size)
        if text_rows:
            rows = to_device_async(torch.tensor(text_rows), device)
            projected[rows] = self.talker.project_text(embeds[rows])
        if len(text_rows) < len(multimodal):
            if any(r[2] is None for r in self._prompt_rows):
                raise ValueError("prompt has audio/image/video rows: feed() needs their accept_hidden states")
            hidden = torch.cat([r[2] for r in self._prompt_rows])
            rows = to_device_async(torch.tensor([row for row, is_mm in enumerate(multimodal) if is_mm]), device)
            projected[rows] = self.talker.project_hidden(hidden[rows])
        user = [row for row, is_user in enumerate(user_row_mask(self.prompt_ids, self.config)) if is_user]
        return projected[to_device_async(torch.tensor(user, dtype=torch.long), device)]
