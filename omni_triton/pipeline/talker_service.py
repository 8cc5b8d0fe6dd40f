"""The talker stage as a service: thinker chunks in (start, then appends), codec frames out.

Used by the Triton talker model and by the in-process pipeline alike. A request enters the engine as
soon as its prefill can be built (whole prompt + the first generated token's row); later thinker
rows are appended while it runs, and when it has no trailing text yet it waits (WAITING_FOR_INPUT)
without holding up the other requests' decoding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from omni_triton import trace
from omni_triton.engine import EngineConfig, EngineLoop, LLMEngine, RequestOutput, SamplingParams, TalkerStage
from omni_triton.engine.handoff import InputStream, complete_to_host, to_device_async
from omni_triton.engine.prefix_cache import embedding_keys
from omni_triton.engine.warmup import warm_up
from omni_triton.load_timeline import LoadTimeline
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_talker, load_thinker_embedding_rows
from omni_triton.pipeline.talker_inputs import TalkerInputs
from omni_triton.pipeline.thinker_service import ThinkerOutput

# The talker's sampling when the request samples (HF generate's talker defaults). Its repetition penalty is a
# request value (TALKER_REPETITION_PENALTY, default 1.05 as in HF generate) and applies to greedy requests too.
TALKER_TEMPERATURE, TALKER_TOP_K = 0.9, 50


@dataclass
class TalkerOutput:
    codes: torch.Tensor  # [n, G] complete codec frames
    finished: bool
    error: str | None = None


@dataclass(frozen=True)
class TalkerRequest:
    speaker_id: int  # codec id of the speaker (config.speaker_id values)
    greedy: bool
    repetition_penalty: float
    seed: int | None = None
    max_frames: int = 0  # 0: until the talker emits EOS (or the KV cache is full)
    min_frames: int = 0
    ignore_eos: bool = False


class TalkerService:
    def __init__(self, checkpoint_dir: str | Path, engine_config: EngineConfig, dtype: torch.dtype = torch.float32,
                 *, load_format: str = "safetensors", seed: int = 0, quantization: str | None = None):
        """``load_format`` dummy: seeded random weights (``seed``, the thinker's too for its embedding rows).
        ``quantization`` as ``ThinkerService``'s."""
        timeline = LoadTimeline("talker")
        self.config = OmniConfig.from_pretrained(checkpoint_dir)
        self.device = torch.device(engine_config.device)
        self.model = load_talker(checkpoint_dir, self.device, dtype, load_format=load_format,
                                 seed=seed, quantization=quantization).eval().requires_grad_(False)
        self.tts_token_embeds = load_thinker_embedding_rows(
            checkpoint_dir, [self.config.tts_bos_token_id, self.config.tts_eos_token_id, self.config.tts_pad_token_id],
            self.device, dtype, load_format=load_format, seed=seed)
        self._speaker_names = {codec_id: name for name, codec_id in self.config.speaker_id.items()}
        self._suppressed = tuple(self.model.suppressed_token_ids().tolist())
        timeline.mark("weights")
        self.engine = LLMEngine(TalkerStage(self.model), engine_config)
        timeline.mark("engine: KV cache, CUDA graphs")
        if engine_config.warmup:
            warm_up(self.engine)  # before the loop starts: no request can arrive while it runs
            timeline.mark("warm-up")
        self.loop = EngineLoop(self.engine).start()
        timeline.report()
        # requests whose prefill is not complete yet (thinker rows still arriving), by request id
        self._pending: dict[str, tuple[TalkerInputs, TalkerRequest, Callable[[TalkerOutput], None]]] = {}
        self._lock = threading.Lock()
        # where a pending request's inputs are built on Triton's thread: its prefill, read to the host for the
        # prefix cache's keys there, waits for that work alone. (Built on the engine's stream, each read waited
        # for every step queued there; made on the engine thread, an admission held the step loop ~15 ms at 64
        # streams on an H200: benchmarks/results/h200-gil-6fd62db.)
        self._build_stream = InputStream(self.device)
        self._prefill_keys = self.engine.block_manager.prefix_caching

    @property
    def num_pending(self) -> int:
        """Requests started but still waiting for the thinker rows that complete their prefill."""
        return len(self._pending)

    def no_frames(self, finished: bool = False) -> TalkerOutput:
        return TalkerOutput(torch.zeros(0, self.model.num_code_groups, dtype=torch.long, device=self.device), finished)

    def sampling_params(self, request: TalkerRequest, prompt_len: int) -> SamplingParams:
        """Frames = talker tokens - 1 (the EOS step yields none), hence the +1s. ``max_frames`` 0 means
        "until the talker stops", bounded by what the KV cache can hold next to the prompt."""
        cache = self.engine.block_manager
        most_frames = cache.num_blocks * cache.block_size - prompt_len - 1
        max_frames = request.max_frames or most_frames
        if max_frames > most_frames:
            raise ValueError(f"MAX_AUDIO_FRAMES {max_frames} does not fit the talker's KV cache "
                             f"({most_frames} frames after a {prompt_len}-position prompt)")
        eos = self.config.talker.codec_eos_token_id
        # ignore_eos (benchmarks: a fixed audio length) must also never *sample* EOS: kept going past it,
        # the EOS id became a frame's first code, outside the codebook, and code2wav rejected the frame
        suppressed = self._suppressed + ((eos,) if request.ignore_eos else ())
        common = dict(repetition_penalty=request.repetition_penalty, seed=request.seed,
                      max_new_tokens=max_frames + 1, min_new_tokens=min(request.min_frames, max_frames),
                      stop_token_ids=(eos,), ignore_eos=request.ignore_eos, suppressed_token_ids=suppressed)
        if request.greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=TALKER_TEMPERATURE, top_k=TALKER_TOP_K, **common)

    @torch.inference_mode()
    def start(self, request_id: str, request: TalkerRequest, first_chunk: ThinkerOutput,
              on_output: Callable[[TalkerOutput], None]) -> None:
        speaker = self._speaker_names.get(request.speaker_id)
        if speaker is None:
            raise ValueError(f"SPEAKER_ID {request.speaker_id} is not a speaker of this checkpoint "
                             f"({sorted(self._speaker_names)})")
        # the rows are the request's owned copy, complete (InputStream): read without waiting for queued steps
        prompt_ids = complete_to_host(first_chunk.row_ids[:first_chunk.prompt_len]).tolist()
        with self._build_stream.building() as hand_over:
            inputs = TalkerInputs(self.model, self.config, prompt_ids, speaker, self.tts_token_embeds)
            hand_over(inputs.kept_tensors())
        with self._lock:
            self._pending[request_id] = (inputs, request, on_output)
        self._feed_pending(request_id, first_chunk)

    def append(self, request_id: str, chunk: ThinkerOutput) -> None:
        with self._lock:
            pending = request_id in self._pending
        if pending:
            with torch.inference_mode():
                self._feed_pending(request_id, chunk)
            return
        # (no inference mode: nothing here is seen by autograd, and entering it took about a tenth of a talker
        # request's Python on Triton's execute thread, once per thinker chunk)
        embeds = chunk.embeds.to(self.device)
        rows = (to_device_async(chunk.row_ids, self.device), embeds, None)
        # the rows' projection launched here, on the engine's stream (its steps that read it are launched after),
        # not by the engine thread when it applies the append: ~0.7 ms of its loop an append at 64 streams
        projected = self.model.project_text(embeds) if embeds.shape[0] else None
        self.loop.append(request_id, thinker_rows=rows, projected_text=projected, finished=chunk.finished)

    def abort(self, request_id: str) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[2](self.no_frames(finished=True))
        else:
            self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()

    def _feed_pending(self, request_id: str, chunk: ThinkerOutput) -> None:
        with self._lock:
            entry = self._pending.get(request_id)
        if entry is None:
            return
        inputs, request, on_output = entry
        p = chunk.prompt_len
        with self._build_stream.building() as hand_over:
            # ids arrive on the host: copied without waiting for the talker's queued steps (to_device_async)
            row_ids = to_device_async(chunk.row_ids, self.device)
            inputs.feed(row_ids[:p], chunk.embeds[:p].to(self.device),
                        chunk.hidden[:p].to(self.device) if p else None)
            inputs.feed(row_ids[p:], chunk.embeds[p:].to(self.device))
            hand_over(inputs.kept_tensors())
            if chunk.finished:
                inputs.finish()
            if not inputs.prefill_ready:
                embeds = None
            else:
                # (its positions are 0..L-1 in all three rope rows: the engine's own without explicit ones, which
                # it would copy to the host at admission, behind the queued steps)
                embeds, _ = inputs.take_prefill()
                hand_over([embeds])
                keys = embedding_keys(embeds) if self._prefill_keys else None
        # complete here, and marked used on the engine's stream: the engine may take them
        if embeds is None and not inputs.nothing_to_speak:
            return  # more thinker rows to come
        with self._lock:
            self._pending.pop(request_id, None)
        if embeds is None:
            on_output(self.no_frames(finished=True))
            return
        try:
            sampling = self.sampling_params(request, embeds.shape[0])
        except ValueError as error:
            on_output(TalkerOutput(self.no_frames().codes, True, str(error)))
            return
        trace.event(request_id, "talker.queued")  # built: what follows is the wait for the engine thread
        self.loop.add_request(request_id, sampling, callback=self._frames(on_output),
                              prompt_embeds=embeds, talker_inputs=inputs, prompt_keys=keys)

    def _frames(self, on_output: Callable[[TalkerOutput], None]) -> Callable[[RequestOutput], None]:
        def deliver(output: RequestOutput) -> None:
            codes = output.extras.get("codes")
            if codes is None:
                codes = self.no_frames().codes
            reason = output.finish_reason or ""
            error = reason[len("error: "):] if reason.startswith("error") else None
            if codes.numel() or output.finished:
                on_output(TalkerOutput(codes, output.finished, error))

        return deliver
