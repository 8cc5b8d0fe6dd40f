"""The thinker stage as a service: one engine loop, requests in, ``ThinkerOutput`` chunks out.

Used by the Triton thinker model and by the in-process pipeline alike. Besides text, each chunk
carries what the talker is conditioned on: for every thinker input row (prompt rows, then each
generated token as it will be fed back) its token id and input embedding, plus the
``accept_hidden_layer`` hidden state of the prompt rows (only audio rows need it). The first chunk
goes out with the first sampled token, so the talker can start right then; a generated token's row
is sent as soon as it is sampled (its embedding is a table lookup), except the last token's, which
is never fed back and so never spoken (as in HF's generate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from omni_triton.engine import EngineConfig, EngineLoop, LLMEngine, RequestOutput, SamplingParams, ThinkerStage
from omni_triton.engine.handoff import to_device_async
from omni_triton.engine.prefix_cache import tensor_digest
from omni_triton.engine.warmup import warm_up
from omni_triton.load_timeline import LoadTimeline
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_thinker


@dataclass
class ThinkerOutput:
    token_ids: torch.Tensor  # [n] newly sampled ids (text)
    row_ids: torch.Tensor  # [m] ids of the thinker input rows in this chunk
    embeds: torch.Tensor  # [m, H] their input embeddings
    hidden: torch.Tensor  # [p, H] accept-layer hidden states of the prompt rows (first chunk only; else [0, H])
    prompt_len: int  # p: rows of the prompt at the head of this chunk
    finished: bool
    error: str | None = None


def merge_appends(outputs: list[ThinkerOutput]) -> ThinkerOutput:
    """Consecutive outputs past a request's first as one (what the talker is appended): rows in order."""
    if any(out.prompt_len for out in outputs):
        raise ValueError("only outputs past the first (no prompt rows) are merged")
    return ThinkerOutput(torch.cat([out.token_ids for out in outputs]), torch.cat([out.row_ids for out in outputs]),
                         torch.cat([out.embeds for out in outputs]), torch.cat([out.hidden for out in outputs]),
                         0, outputs[-1].finished)


@dataclass(frozen=True)
class ThinkerRequest:
    input_ids: list[int]
    sampling: SamplingParams
    audio_features: torch.Tensor | None = None  # [128, T] log-mel of the spoken input


class _RequestRows:
    """Per-request assembly of engine outputs into ThinkerOutputs (runs on the engine's response thread)."""

    def __init__(self, prompt_ids: list[int], embed: Callable[[torch.Tensor], torch.Tensor],
                 on_output: Callable[[ThinkerOutput], None]):
        self.prompt_ids = prompt_ids
        self.embed = embed
        self.on_output = on_output
        self.prompt_embeds: list[torch.Tensor] = []
        self.prompt_hidden: list[torch.Tensor] = []
        self.prompt_rows_seen = 0
        self.first_sent = False

    def __call__(self, output: RequestOutput) -> None:
        if output.states and self.prompt_rows_seen < len(self.prompt_ids):
            take = min(len(self.prompt_ids) - self.prompt_rows_seen, output.states["input_embeds"].shape[0])
            self.prompt_embeds.append(output.states["input_embeds"][:take])
            self.prompt_hidden.append(output.states["accept_hidden"][:take])
            self.prompt_rows_seen += take
        if not output.new_token_ids and not output.finished:
            return  # a prefill chunk: nothing to send until the first token exists
        reason = output.finish_reason or ""
        error = reason[len("error: "):] if reason.startswith("error") else None
        if error is not None or (not self.first_sent and self.prompt_rows_seen < len(self.prompt_ids)):
            # failed, or aborted before the prompt was computed: close the stream with nothing to speak
            empty = torch.zeros(0, dtype=torch.long)
            self.on_output(ThinkerOutput(empty, empty, torch.zeros(0, 0), torch.zeros(0, 0), 0, True, error))
            return
        new_ids = torch.tensor(output.new_token_ids, dtype=torch.long)
        # the finishing token is never fed back to the thinker, so the talker never sees its row
        fed_ids = new_ids[:-1] if output.finished else new_ids
        # embedded from the ids where the step sampled them: no host -> device copy (which would wait for every
        # step queued on the stage's stream)
        sampled = output.token_ids_device if output.token_ids_device is not None else new_ids
        fed_embeds = self.embed(sampled[:len(fed_ids)])
        if self.first_sent:
            row_ids, embeds, hidden, prompt_len = fed_ids, fed_embeds, fed_embeds[:0], 0
        else:
            row_ids = torch.cat([torch.tensor(self.prompt_ids, dtype=torch.long), fed_ids])
            embeds = torch.cat([*self.prompt_embeds, fed_embeds])
            hidden, prompt_len = torch.cat(self.prompt_hidden), len(self.prompt_ids)
            self.prompt_embeds, self.prompt_hidden, self.first_sent = [], [], True
        self.on_output(ThinkerOutput(new_ids, row_ids, embeds, hidden, prompt_len, output.finished))


class ThinkerService:
    def __init__(self, checkpoint_dir: str | Path, engine_config: EngineConfig, dtype: torch.dtype = torch.float32,
                 *, load_format: str = "safetensors", seed: int = 0, quantization: str | None = None):
        """``load_format`` dummy: seeded random weights (``seed``) from the checkpoint dir's config.json.
        ``quantization`` "fp8": block-FP8 weights quantized at load (``models.quantization``)."""
        timeline = LoadTimeline("thinker")
        self.config = OmniConfig.from_pretrained(checkpoint_dir)
        self.device = torch.device(engine_config.device)
        self.model = load_thinker(checkpoint_dir, self.device, dtype, with_audio=True, load_format=load_format,
                                  seed=seed, quantization=quantization).eval().requires_grad_(False)
        timeline.mark("weights")
        # the talker takes the states of the prompt only (_RequestRows): generated positions stream none
        stage = ThinkerStage(self.model, audio_token_id=self.config.thinker.audio_token_id,
                             accept_hidden_layer=self.config.accept_hidden_layer, states_past_prompt=False)
        self.engine = LLMEngine(stage, engine_config)
        timeline.mark("engine: KV cache, CUDA graphs")
        if engine_config.warmup:
            warm_up(self.engine)  # before the loop starts: no request can arrive while it runs
            timeline.mark("warm-up")
        self.loop = EngineLoop(self.engine).start()
        timeline.report()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.thinker_eos_token_ids

    def submit(self, request_id: str, request: ThinkerRequest, on_output: Callable[[ThinkerOutput], None]) -> None:
        """Raises ValueError for ids outside the vocabulary: inside the engine step they would fail the whole
        batch, every other request in it too (callers that skip preprocess can send any ids)."""
        vocab_size = self.config.thinker.text.vocab_size
        bad = [token for token in request.input_ids if not 0 <= token < vocab_size]
        if bad:
            raise ValueError(f"INPUT_IDS must be in [0, {vocab_size - 1}] (the thinker's vocabulary), got {bad[:8]}")
        audio_embeds = self._encode_audio(request.audio_features)
        rows = _RequestRows(list(request.input_ids), self._embed, on_output)
        inputs = {"prompt_token_ids": list(request.input_ids)}
        if audio_embeds is not None:
            inputs["audio_embeds"] = audio_embeds
            if self.engine.block_manager.prefix_caching:  # names the audio rows' blocks by the recording's features
                inputs["audio_key"] = tensor_digest(request.audio_features)
        self.loop.add_request(request_id, request.sampling, callback=rows, **inputs)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()

    @torch.inference_mode()
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(to_device_async(ids, self.device))

    @torch.inference_mode()
    def _encode_audio(self, features: torch.Tensor | None) -> torch.Tensor | None:
        if features is None or features.numel() == 0:
            return None
        encoder = self.model.audio_encoder
        features = features.to(self.device, next(encoder.parameters()).dtype)
        return encoder(features[None], [features.shape[-1]])
