"""The narrow hook that lets one engine serve both the thinker and the talker.

The engine owns scheduling, KV blocks, batching and sampling; a ``StageModel`` owns what is model-specific:
how a sequence's pending positions become input embeddings, which per-position states are streamed out,
what happens after a token is sampled (the thinker feeds it back; the talker predicts the rest of the codec
frame and adds the next trailing-text embedding), and what a client may append to a running request.

The work after sampling comes in two halves so the runner can put the device half into a CUDA graph:
``complete_step`` (tensors only: the talker's code predictor, drawing from the extra sampling streams the
stage names in ``sample_streams``) and ``after_sample`` (host bookkeeping on its outputs).
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from omni_triton.engine.embed_rows import EmbedRows
from omni_triton.engine.handoff import to_device_async
from omni_triton.engine.prefix_cache import KEY_BYTES, audio_position_keys, embedding_keys, tensor_digest, token_keys
from omni_triton.engine.sampling import SampleRow, SamplingParams
from omni_triton.engine.sequence import Sequence

Chunk = tuple[Sequence, int, int]  # (sequence, first position, end position) computed this step
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]  # (logits [B, V], group) -> ids [B]
# The talker's code predictor draws from its own stream, seeded from the request's seed but apart from its draws.
PREDICTOR_SEED_OFFSET = 0x5EED


class StageModel(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    def init_sequence(self, seq: Sequence, **stage_inputs) -> None:
        """Attach per-request inputs (audio embeds, talker prefill embeds, ...) to ``seq.stage_state``."""

    def embed_inputs(self, chunks: list[Chunk]) -> torch.Tensor:
        """Input embeddings [T, H] of every chunk's positions, concatenated in chunk order."""

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, batch
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (final hidden [T, H], per-row states [T, ...] to stream out, by name)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32."""

    sample_streams: dict[str, Callable[[Sequence], SampleRow]]  # extra draws of complete_step, by name

    def complete_step(self, hidden: torch.Tensor, token_ids: torch.Tensor, sample_fns: dict[str, SampleFn]
                      ) -> dict[str, torch.Tensor]:
        """Rows that sampled ``token_ids`` from ``hidden``: the stage's device work on them (no host reads),
        per-row tensors by name."""

    def after_sample(self, seqs: list[Sequence], completed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Unfinished rows, with their rows of ``complete_step``'s outputs: make their next input (or leave them
        waiting for one). Returns per-row extra outputs."""

    def append_input(self, seq: Sequence, **inputs) -> None:
        """Client data for a running request (the talker's trailing text)."""

    def warmup_inputs(self, num_positions: int) -> dict:
        """``add_request`` inputs of a dummy request with ``num_positions`` prompt positions that runs to its
        max_new_tokens without waiting for input (``engine.warmup``)."""

    # Prefix caching (``prefix_cache``, ``kept_states``):
    def cache_keys(self, seq: Sequence) -> np.ndarray:
        """[P, 16] uint8: a key per prompt position naming its input (two inputs share a key only if equal)."""

    kept_states: dict[str, int]  # streamed states kept beside the KV blocks for cached positions: name -> width

    def recompute_states(self, seq: Sequence, start: int, end: int) -> dict[str, torch.Tensor]:
        """The other streamed states of cached positions start..end-1, made from their inputs."""

    # Optional, as a pair (the thinker): ``decode_token_ids(chunks) -> list[int] | None``, the token ids of
    # one-position decode chunks (None when some position needs more than its token's embedding), and
    # ``embed_token_ids(ids [B]) -> [B, H]``, which a decode CUDA graph runs itself (no eager embedding step).
    # Optional (the talker): ``inputs_ahead(seqs, completed) -> [N, H] | None``, the rows' next inputs from a
    # step's completion on the device, before ``after_sample`` (None when some row has no next input yet), and
    # ``input_ready_ahead(seq) -> bool``, whether a row has it (rows that do not stay out of a step launched ahead).
    # Optional, what the engine's outputs carry (default True, both): ``states_past_prompt``, the streamed states
    # of generated positions too, not only the prompt's; ``device_token_ids``, each output's sampled ids on the
    # device (``RequestOutput.token_ids_device``). Off, the engine makes no per-row views of them.


class ThinkerStage:
    """Token ids in, token ids out; optionally streams each position's input embedding and the hidden state
    after ``accept_hidden_layer`` layers (what the talker is conditioned on): of every position, or with
    ``states_past_prompt`` off of the prompt's only (the talker takes the states of the prompt and embeds the
    generated tokens again from the ids the step sampled on the device, ``RequestOutput.token_ids_device``)."""

    sample_streams: dict = {}
    device_token_ids = True  # the outputs carry their sampled ids on the device

    def __init__(self, thinker, *, audio_token_id: int | None = None, accept_hidden_layer: int | None = None,
                 states_past_prompt: bool = True):
        self.model = thinker
        self.states_past_prompt = states_past_prompt
        self.num_layers, self.num_kv_heads = thinker.num_layers, thinker.num_kv_heads
        self.head_dim, self.hidden_size = thinker.head_dim, thinker.hidden_size
        self.audio_token_id = audio_token_id
        self.accept_hidden_layer = accept_hidden_layer

    @property
    def kept_states(self) -> dict[str, int]:
        return {} if self.accept_hidden_layer is None else {"accept_hidden": self.hidden_size}

    def init_sequence(self, seq: Sequence, audio_embeds: torch.Tensor | None = None,
                      audio_key: bytes | None = None) -> None:
        """``audio_embeds`` [K, H]: encoder outputs for the K audio placeholder tokens of the prompt, in order;
        ``audio_key``: a digest of the recording they were encoded from (prefix caching; default: of the embeds)."""
        if len(seq.prompt_token_ids) != seq.num_prompt_positions:
            raise ValueError(f"request {seq.request_id!r}: thinker needs one token id per prompt position")
        if audio_embeds is None:
            seq.stage_state = None
            return
        if self.audio_token_id is None:
            raise ValueError("audio_embeds given but ThinkerStage has no audio_token_id")
        where = [p for p, t in enumerate(seq.prompt_token_ids) if t == self.audio_token_id]
        if len(where) != audio_embeds.shape[0]:
            raise ValueError(f"request {seq.request_id!r}: {audio_embeds.shape[0]} audio embeds for "
                             f"{len(where)} audio tokens (id {self.audio_token_id}) in the prompt")
        seq.stage_state = (torch.tensor(where, dtype=torch.long), audio_embeds, audio_key)

    def cache_keys(self, seq: Sequence) -> np.ndarray:
        keys = token_keys(seq.prompt_token_ids)
        if seq.stage_state is not None:
            where, audio, audio_key = seq.stage_state
            keys[where.numpy()] = audio_position_keys(audio_key or tensor_digest(audio), len(where))
        return keys

    def recompute_states(self, seq: Sequence, start: int, end: int) -> dict[str, torch.Tensor]:
        return {"input_embeds": self.embed_inputs([(seq, start, end)])}

    def embed_inputs(self, chunks: list[Chunk]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = [tid for seq, start, end in chunks for tid in _token_ids(seq, start, end)]
        # (ids and row indices from pinned memory: a copy from pageable memory waits for the engine's stream, behind
        # the step launched ahead of this one)
        embeds = self.model.embed(to_device_async(torch.tensor(ids, dtype=torch.long), device))
        row = 0
        for seq, start, end in chunks:
            if seq.stage_state is not None:
                where, audio, _ = seq.stage_state
                inside = (where >= start) & (where < end)
                if inside.any():
                    rows = to_device_async(where[inside] - start + row, device)
                    taken = to_device_async(inside.nonzero().squeeze(1), audio.device)
                    embeds[rows] = audio[taken].to(device=device, dtype=embeds.dtype)
            row += end - start
        return embeds

    def decode_token_ids(self, chunks: list[Chunk]) -> list[int] | None:
        """Past the prompt every position's input is its token's embedding; a prompt position may be audio."""
        if any(start < seq.num_prompt_positions for seq, start, _ in chunks):
            return None
        return [tid for seq, start, end in chunks for tid in _token_ids(seq, start, end)]

    def embed_token_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)

    def forward(self, inputs_embeds, positions, batch):
        capture = () if self.accept_hidden_layer is None else (self.accept_hidden_layer,)
        hidden, captured = self.model(inputs_embeds, positions, batch, capture_layers=capture)
        if self.accept_hidden_layer is None:
            return hidden, {}
        return hidden, {"input_embeds": inputs_embeds, "accept_hidden": captured[self.accept_hidden_layer]}

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)

    def complete_step(self, hidden, token_ids, sample_fns):
        return {}

    def after_sample(self, seqs, completed):
        for seq in seqs:
            seq.num_inputs += 1  # the sampled token is the next input
        return [{} for _ in seqs]

    def append_input(self, seq, **inputs):
        raise ValueError(f"request {seq.request_id!r}: the thinker takes no appended input")

    def warmup_inputs(self, num_positions):
        return {"prompt_token_ids": [p % self.model.vocab_size for p in range(1, num_positions + 1)]}


def _token_ids(seq: Sequence, start: int, end: int) -> list[int]:
    prompt = seq.prompt_token_ids
    return [prompt[p] if p < len(prompt) else seq.output_token_ids[p - len(prompt)] for p in range(start, end)]


def _same_inputs(ahead: tuple | None, codec: torch.Tensor, seqs: list[Sequence], texts: list[torch.Tensor]) -> bool:
    """Whether ``inputs_ahead``'s inputs (``ahead``) are the sums of ``codec`` and ``texts`` for ``seqs``, every
    row of them: the same tensor objects each (identity, no values compared)."""
    return (ahead is not None and ahead[0] is codec and len(ahead[1]) == len(seqs) == len(texts)
            and all(map(operator.is_, ahead[1], seqs)) and all(map(operator.is_, ahead[2], texts)))


class TrailingTextQueue:
    """Trailing text pushed by the client: appended rows in order, then (once finished) tts_eos, then tts_pad.
    Same ``next_trailing`` contract as ``pipeline.talker_inputs.TalkerInputs``, which can be used instead."""

    def __init__(self, tts_eos_embed: torch.Tensor, tts_pad_embed: torch.Tensor):
        self.tts_eos_embed, self.tts_pad_embed = tts_eos_embed, tts_pad_embed
        self.rows: deque[torch.Tensor] = deque()
        self.finished = False
        self._eos_sent = False

    def append(self, trailing_text_embeds: torch.Tensor | None, finished: bool) -> None:
        if trailing_text_embeds is not None and len(trailing_text_embeds):
            if self.finished:
                raise ValueError("trailing text appended after finished=True")
            self.rows.extend(trailing_text_embeds.reshape(-1, trailing_text_embeds.shape[-1]).unbind(0))
        self.finished = self.finished or finished

    def next_trailing(self) -> torch.Tensor | None:
        embed = self.peek_trailing()
        if self.rows:
            self.rows.popleft()
        elif embed is not None:
            self._eos_sent = True
        return embed

    def peek_trailing(self) -> torch.Tensor | None:
        """What ``next_trailing`` would return now, without taking it."""
        if self.rows:
            return self.rows[0]
        if not self.finished:
            return None
        return self.tts_pad_embed if self._eos_sent else self.tts_eos_embed


@dataclass
class TalkerState:
    input_embeds: EmbedRows  # per position [H] (prefill rows, then one row per fed frame)
    predictor_row: SampleRow
    trailing: object  # TrailingTextQueue or TalkerInputs: next_trailing() / peek_trailing() -> [H] | None
    pending_codec_embeds: torch.Tensor | None = None  # last frame's codec embeds, waiting for trailing text
    prompt_keys: np.ndarray | None = None  # the prompt's prefix-cache keys, when the caller made them


class TalkerStage:
    """Codec ids out. Each step's input = previous frame's summed codebook embeddings + the next trailing-text
    embedding. Trailing text comes either from client appends of projected text rows
    (``trailing_text_embeds`` [n, H], ``finished``) or from a per-request ``TalkerInputs`` fed with raw thinker
    rows (``thinker_rows=(ids, input_embeds, accept_hidden)``, ``finished``); both are applied on the engine
    thread, so the request's state is never touched concurrently."""

    def __init__(self, talker, *, tts_eos_embed: torch.Tensor | None = None,
                 tts_pad_embed: torch.Tensor | None = None):
        """``tts_eos_embed``/``tts_pad_embed`` [H] (talker.project_text of the thinker embeddings of those ids)
        are needed only for requests without their own ``TalkerInputs``."""
        self.model = talker
        self.num_layers, self.num_kv_heads = talker.num_layers, talker.num_kv_heads
        self.head_dim, self.hidden_size = talker.head_dim, talker.hidden_size
        self.tts_eos_embed = None if tts_eos_embed is None else tts_eos_embed.reshape(-1)
        self.tts_pad_embed = None if tts_pad_embed is None else tts_pad_embed.reshape(-1)
        self.sample_streams = {"predictor": lambda seq: seq.stage_state.predictor_row}
        self.kept_states: dict[str, int] = {}  # it streams no per-position states
        self.device_token_ids = False  # its consumer reads the codes (extras), which hold the sampled ids
        # the last inputs_ahead's (codec embeds, rows, their texts, inputs): after_sample takes those inputs again
        # when it pushes the same rows' same texts onto the same codec embeds (a steady overlapped step)
        self._inputs_ahead: tuple | None = None

    @staticmethod
    def default_predictor_params(params: SamplingParams) -> SamplingParams:
        """The code predictor samples (top_k 50, top_p 0.8) when the talker samples, else it is greedy."""
        if params.greedy:
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=1.0, top_k=50, top_p=0.8)

    def init_sequence(self, seq: Sequence, prompt_embeds: torch.Tensor, talker_inputs=None,
                      trailing_text_embeds: torch.Tensor | None = None, thinker_finished: bool = False,
                      prompt_keys: np.ndarray | None = None) -> None:
        """``prompt_embeds`` [P, H]: the talker prefill (user segments + assistant positions). ``prompt_keys``
        [P, 16]: ``prefix_cache.embedding_keys(prompt_embeds)``, made already by the caller (the served talker reads
        the prefill to the host on Triton's thread, on the stream it was built on: read here, on the engine's
        stream, the copy would wait for every step queued there)."""
        if prompt_embeds.shape != (seq.num_prompt_positions, self.hidden_size):
            raise ValueError(f"request {seq.request_id!r}: prompt_embeds shape {tuple(prompt_embeds.shape)}, "
                             f"expected ({seq.num_prompt_positions}, {self.hidden_size})")
        if talker_inputs is None:
            if self.tts_eos_embed is None or self.tts_pad_embed is None:
                raise ValueError(f"request {seq.request_id!r}: no talker_inputs and the TalkerStage has no "
                                 "tts_eos_embed/tts_pad_embed for a plain trailing-text queue")
            talker_inputs = TrailingTextQueue(self.tts_eos_embed, self.tts_pad_embed)
        predictor_params = seq.params.extra.get("predictor") or self.default_predictor_params(seq.params)
        predictor_row = SampleRow(predictor_params, seq.sample_row.generator,
                                  seed=(seq.sample_row.seed + PREDICTOR_SEED_OFFSET) % (1 << 62))
        if prompt_keys is not None and prompt_keys.shape != (seq.num_prompt_positions, KEY_BYTES):
            raise ValueError(f"request {seq.request_id!r}: prompt_keys shape {prompt_keys.shape}, "
                             f"expected ({seq.num_prompt_positions}, {KEY_BYTES})")
        seq.stage_state = TalkerState(EmbedRows.of_batch(prompt_embeds), predictor_row, talker_inputs,
                                      prompt_keys=prompt_keys)
        self.append_input(seq, trailing_text_embeds=trailing_text_embeds, finished=thinker_finished)

    def embed_inputs(self, chunks):
        # (a copy, as a stack made it: a prefill's rows are a slice of its prompt's tensor, kept for recomputes)
        return torch.cat([seq.stage_state.input_embeds.tensor(start, end) for seq, start, end in chunks])

    def cache_keys(self, seq):
        """Digests of the prompt embeddings' bytes: a later turn's prompt repeats the earlier turns' user rows, the
        same values where the thinker streamed the same states for them and their projection rounded alike. (The
        caller's ``prompt_keys`` where it gave them; else a copy to the host here, behind the queued steps.)"""
        state: TalkerState = seq.stage_state
        if state.prompt_keys is not None:
            return state.prompt_keys
        return embedding_keys(state.input_embeds.tensor(0, seq.num_prompt_positions))

    def recompute_states(self, seq, start, end):
        return {}

    def forward(self, inputs_embeds, positions, batch):
        return self.model(inputs_embeds, positions, batch), {}

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)

    def complete_step(self, hidden, token_ids, sample_fns):
        codes, next_embeds = self.model.predict_frame(hidden, token_ids, sample_fns["predictor"])
        return {"codes": codes, "next_embeds": next_embeds}

    @staticmethod
    def input_ready_ahead(seq: Sequence) -> bool:
        """Whether the row's next trailing text is here: its next input can be made before ``after_sample``
        (``inputs_ahead``); else the row waits for input after this frame and stays out of a step launched ahead."""
        return seq.stage_state.trailing.peek_trailing() is not None

    def inputs_ahead(self, seqs, completed) -> torch.Tensor | None:
        """The rows' next inputs [N, H] from a frame's completion still on the device, before ``after_sample``
        takes their trailing text (``overlap.StepOverlap``): the values it will push, or None while a row waits
        for text."""
        texts = [seq.stage_state.trailing.peek_trailing() for seq in seqs]
        if any(text is None for text in texts):
            return None
        codec = completed["next_embeds"]
        inputs = codec + torch.stack(texts).to(codec)
        self._inputs_ahead = (codec, list(seqs), texts, inputs)
        return inputs

    def after_sample(self, seqs, completed):
        """Each row's next input = its frame's codec embeds + its next trailing text, added for all the rows that
        have their text in one launch (a launch per row: 64 launches a step at 64 rows, ~1 ms of host time under
        the profiler)."""
        next_embeds = completed["next_embeds"]
        ahead, self._inputs_ahead = self._inputs_ahead, None
        texts = [seq.stage_state.trailing.next_trailing() for seq in seqs]
        ready = range(len(seqs))
        if any(text is None for text in texts):  # (the steady state: none, and no per-row lists to build)
            ready = [i for i, text in enumerate(texts) if text is not None]
            for i, text in enumerate(texts):
                if text is None:  # WAITING_FOR_INPUT until the thinker sends more text; fed by append_input then
                    seqs[i].stage_state.pending_codec_embeds = next_embeds[i]
            texts = [text for text in texts if text is not None]
        if ready:
            if _same_inputs(ahead, next_embeds, seqs, texts):
                inputs = ahead[3]  # the values made below: the same sum of the same tensors
            else:
                # (rows waiting for text: gathered by a device index copied without waiting for the step launched
                # ahead)
                codec = (next_embeds if len(ready) == len(seqs)
                         else next_embeds[to_device_async(torch.tensor(ready), next_embeds.device)])
                inputs = codec + torch.stack(texts).to(codec)
            for row, i in enumerate(ready):  # _push_input, inlined (every row of every step), no view made per row
                seq = seqs[i]
                state = seq.stage_state
                state.input_embeds.append_row_of(inputs, row)
                state.pending_codec_embeds = None
                seq.num_inputs += 1
        return [{"codes": codes} for codes in completed["codes"].split(1)]  # (a row's view each, in one call)

    def append_input(self, seq, trailing_text_embeds: torch.Tensor | None = None, thinker_rows=None,
                     finished: bool = False, projected_text: torch.Tensor | None = None) -> None:
        """``projected_text``: the talker's projection of ``thinker_rows``' input embeds, when the caller made it
        (``TalkerInputs.feed``)."""
        source = seq.stage_state.trailing
        try:
            if isinstance(source, TrailingTextQueue):
                if thinker_rows is not None:
                    raise ValueError("thinker_rows need a request added with talker_inputs")
                source.append(trailing_text_embeds, finished)
            else:
                if trailing_text_embeds is not None:
                    raise ValueError("trailing_text_embeds given for a request fed through talker_inputs")
                if thinker_rows is not None:
                    source.feed(*thinker_rows, projected_text=projected_text)
                if finished and not source.finished:
                    source.finish()
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"request {seq.request_id!r}: {exc}") from exc
        self._feed(seq)

    def warmup_inputs(self, num_positions):
        # the talker's inputs are sums of codec embedding rows: their dtype, not its first parameter's (an FP8
        # weight when the talker's linears are FP8)
        weight = next(module.weight for module in self.model.modules() if isinstance(module, torch.nn.Embedding))
        zeros = torch.zeros(num_positions, self.hidden_size, dtype=weight.dtype, device=weight.device)
        # trailing text finished at once: tts_eos then tts_pad every step, so the request never waits for input
        return {"prompt_embeds": zeros, "talker_inputs": TrailingTextQueue(zeros[0], zeros[0]),
                "thinker_finished": True}

    def _feed(self, seq: Sequence) -> None:
        """Turn the pending codec embeds into the next input once its trailing-text embedding is known."""
        state: TalkerState = seq.stage_state
        if state.pending_codec_embeds is None:
            return
        text = state.trailing.next_trailing()
        if text is None:
            return  # WAITING_FOR_INPUT until the thinker sends more text
        self._push_input(seq, state.pending_codec_embeds + text.to(state.pending_codec_embeds))

    @staticmethod
    def _push_input(seq: Sequence, embeds: torch.Tensor) -> None:
        """``embeds`` [H] (codec embeds + trailing text) becomes the sequence's next input."""
        state: TalkerState = seq.stage_state
        state.input_embeds.append(embeds)
        state.pending_codec_embeds = None
        seq.num_inputs += 1
