"""One runner per benchmarked system. A runner opens workers (one per concurrent client); a worker sends
one request at a time and returns what its client saw as a RequestTiming."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import numpy as np

from omni_triton.bench.metrics import RequestTiming


class Worker(Protocol):
    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming: ...

    def close(self) -> None: ...


class Runner(Protocol):
    name: str
    sequential: bool            # sends SEQUENTIAL=true (the server's baseline mode)
    max_concurrency: int | None  # None: any

    def open_worker(self) -> Worker: ...

    def close(self) -> None: ...


class SharedWorker:
    """A worker over a runner whose model serves every worker at once (closing it closes nothing)."""

    def __init__(self, request):
        self.request = request

    def close(self) -> None:
        pass


def time_request(events: Callable[[], Iterator[tuple[bool, int]]]) -> RequestTiming:
    """Time one request of an in-process system: ``events()`` yields (text arrived, audio samples arrived)
    whenever the caller would see output; an exception becomes the timing's error."""
    timing = RequestTiming()
    start = time.perf_counter()
    try:
        for has_text, samples in events():
            now = time.perf_counter() - start
            if has_text:
                timing.text_times.append(now)
            if samples:
                timing.audio_chunks.append((now, samples))
    except Exception as error:
        timing.error = f"{type(error).__name__}: {error}"
    timing.total_s = time.perf_counter() - start
    return timing
