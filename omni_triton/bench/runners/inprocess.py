"""The same pipeline without Triton: InProcessPipeline in this process, stages called directly, with the
served stages' settings (weights and their load format, dtype, engine configs, KV budget, audio chunking)."""

from __future__ import annotations

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker, time_request
from omni_triton.shared.settings import LaunchConfig


class InProcessRunner:
    name = "inprocess"
    sequential = False
    max_concurrency = None

    def __init__(self, config: LaunchConfig):
        import torch

        from omni_triton.pipeline.inprocess import InProcessPipeline
        from omni_triton.stages.model_args import chunk_policy, engine_config, quantization

        # each engine and the chunking as the served stages build them from the same settings
        device = torch.device(config.device)
        (thinker, dtype), (talker, _) = (engine_config(config, stage, device) for stage in ("thinker", "talker"))
        self.pipeline = InProcessPipeline(
            config.checkpoint_dir, device=config.device, dtype=dtype, engine_config=thinker,
            talker_engine_config=talker, load_format=config.load_format, seed=config.dummy_seed,
            policy=chunk_policy(config), chunk_pacing=config.chunk_pacing, quantization=quantization(config))

    def open_worker(self) -> SharedWorker:
        return SharedWorker(self.request)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        def events():
            for delta, audio in self.pipeline.stream(tensors):
                yield bool(delta), int(audio.numel()) if audio is not None else 0

        return time_request(events)

    def close(self) -> None:
        self.pipeline.close()
