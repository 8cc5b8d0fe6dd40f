"""The same pipeline without Triton: InProcessPipeline in this process, stages called directly."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker


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
        timing = RequestTiming()
        start = time.perf_counter()
        try:
            for delta, audio in self.pipeline.stream(tensors):
                now = time.perf_counter() - start
                if delta:
                    timing.text_times.append(now)
                if audio is not None and audio.numel():
                    timing.audio_chunks.append((now, int(audio.numel())))
        except Exception as error:
            timing.error = f"{type(error).__name__}: {error}"
        timing.total_s = time.perf_counter() - start
        return timing

    def close(self) -> None:
        self.pipeline.close()
