"""Closed-loop load: `concurrency` workers, each sending its next request as soon as the last one ends."""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import Runner


def run_level(runner: Runner, tensors: dict[str, np.ndarray], concurrency: int, num_requests: int,
              on_done: Callable[[RequestTiming], None] | None = None) -> tuple[list[RequestTiming], float]:
    """Send ``num_requests`` requests through ``concurrency`` workers; returns the timings and the wall time
    from the first request sent to the last response received."""
    if concurrency < 1 or num_requests < 1:
        raise ValueError(f"concurrency and num_requests must be >= 1, got {concurrency} and {num_requests}")
    workers = [runner.open_worker() for _ in range(concurrency)]  # connections are not part of the wall time
    timings: list[RequestTiming] = []
    lock = threading.Lock()
    remaining = [num_requests]

    def take() -> bool:
        with lock:
            remaining[0] -= 1
            return remaining[0] >= 0

    def work(worker) -> None:
        while take():
            timing = worker.request(tensors)
            with lock:
                timings.append(timing)
            if on_done is not None:
                on_done(timing)

    threads = [threading.Thread(target=work, args=(worker,), daemon=True) for worker in workers]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    for worker in workers:
        worker.close()
    return timings, wall_s
