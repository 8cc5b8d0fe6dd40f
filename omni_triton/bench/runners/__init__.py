"""One runner per benchmarked system. A runner opens workers (one per concurrent client); a worker sends
one request at a time and returns what its client saw as a RequestTiming."""

from __future__ import annotations

from typing import Protocol

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
