"""One short request through each served pipeline before ``serve`` says ready: the served path's first-use costs
(every stage's warm-up covers its own steps, not the hand-offs between the processes) are paid here, not by the
first user. On one H200 at full size, with every stage warmed up, the first spoken turn after start still took
1.4 s from the end of speech to its first audio and every later turn 0.1 s (benchmarks/results/h200-api)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

# a few thinker tokens and the first audio chunk's frames, greedy, whatever the model says
FIRST_REQUEST = dict(max_tokens=4, min_tokens=4, ignore_eos=True, max_audio_frames=32, min_audio_frames=32,
                     temperature=0.0)


def send_first_requests(grpc_url: str, count: int = 1, timeout_s: float = 300.0) -> float:
    """``count`` requests at once (one per pipeline: each new request goes to the least loaded one), each to its
    final response; the seconds they took. Raises the client's StreamError for one that failed."""
    from omni_triton.client import OmniStreamClient

    def send(_: int) -> None:
        with OmniStreamClient(grpc_url) as client:
            client.stream("Hello.", timeout_s=timeout_s, **FIRST_REQUEST)

    start = time.monotonic()
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(send, range(count)))
    return time.monotonic() - start
