"""The same pipeline without Triton: InProcessPipeline in this process, stages called directly, with the
served stages' settings (weights and their load format, dtype, engine configs, KV budget, audio chunking)."""

from __future__ import annotations

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker, time_request
from omni_triton.server.repository import LaunchConfig


class InProcessRunner:
    name = "inprocess"
    sequential = False
    max_concurrency = None

    def __init__(self, config: LaunchConfig):
        from omni_triton.pipeline.code2wav_stream import ChunkPolicy
        from omni_triton.pipeline.inprocess import InProcessPipeline
        from omni_triton.server.stage_io import engine_config

        # each engine as its served stage reads it from its config.pbtxt parameters
        (thinker, dtype), (talker, _) = (engine_config(config.template_values(stage))
                                         for stage in ("thinker", "talker"))
        self.pipeline = InProcessPipeline(
            config.checkpoint_dir, device=config.device, dtype=dtype, engine_config=thinker,
            talker_engine_config=talker, load_format=config.load_format, seed=config.dummy_seed,
            policy=ChunkPolicy.from_setting(config.first_chunk_frames, config.next_chunk_frames,
                                            config.resolved_left_context_frames),
            chunk_pacing=config.chunk_pacing,
            quantization=None if config.quantization == "none" else config.quantization)

    def open_worker(self) -> SharedWorker:
        return SharedWorker(self.request)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        def events():
            for delta, audio in self.pipeline.stream(tensors):
                yield bool(delta), int(audio.numel()) if audio is not None else 0

        return time_request(events)

    def close(self) -> None:
        self.pipeline.close()
