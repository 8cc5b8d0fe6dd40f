"""The same pipeline without Triton: InProcessPipeline in this process, stages called directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker, time_request


class InProcessRunner:
    name = "inprocess"
    sequential = False
    max_concurrency = None

    def __init__(self, checkpoint_dir: str | Path, device: str = "cpu"):
        from omni_triton.pipeline.inprocess import InProcessPipeline

        self.pipeline = InProcessPipeline(checkpoint_dir, device=device)

    def open_worker(self) -> SharedWorker:
        return SharedWorker(self.request)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        def events():
            for delta, audio in self.pipeline.stream(tensors):
                yield bool(delta), int(audio.numel()) if audio is not None else 0

        return time_request(events)

    def close(self) -> None:
        self.pipeline.close()
