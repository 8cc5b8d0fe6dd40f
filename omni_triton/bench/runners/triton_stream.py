"""The served pipeline: `omni` over gRPC streams, one stream per worker (streaming or SEQUENTIAL mode)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.client import OmniStreamClient


class TritonStreamRunner:
    max_concurrency = None

    def __init__(self, url: str, *, sequential: bool = False, model: str = "omni", timeout_s: float = 600.0):
        self.name = "server-sequential" if sequential else "server"
        self.sequential = sequential
        self.url, self.model, self.timeout_s = url, model, timeout_s

    def open_worker(self) -> "TritonStreamWorker":
        return TritonStreamWorker(OmniStreamClient(self.url, self.model), self.timeout_s)

    def close(self) -> None:
        pass


class TritonStreamWorker:
    def __init__(self, client: OmniStreamClient, timeout_s: float):
        self.client, self.timeout_s = client, timeout_s

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        text = tensors["TEXT"].reshape(-1)[0].decode("utf-8")
        scalars = {name.lower(): value.reshape(-1)[0].item() for name, value in tensors.items() if name != "TEXT"}
        return self.stream_timed(RequestTiming(), text, **scalars)

    def stream_timed(self, timing: RequestTiming, text: str, audio_in: np.ndarray | None = None,
                     after_chunk: Callable[[], None] | None = None, **options) -> RequestTiming:
        """Stream one request, recording what its client saw into ``timing``; ``after_chunk()`` runs after each
        audio chunk is recorded (e.g. a cancel mid-stream); ``options``: OmniStreamClient.stream's."""
        start = time.perf_counter()

        def on_audio(chunk: np.ndarray) -> None:
            timing.audio_chunks.append((time.perf_counter() - start, chunk.size))
            if after_chunk is not None:
                after_chunk()

        try:
            self.client.stream(
                text, audio_in, timeout_s=self.timeout_s,
                on_text=lambda delta: timing.text_times.append(time.perf_counter() - start), on_audio=on_audio,
                **options)
        except Exception as error:  # a failed request is a result to report, not a crash of the benchmark
            timing.error = f"{type(error).__name__}: {error}"
            timing.error_code = getattr(error, "code", type(error).__name__)
        timing.total_s = time.perf_counter() - start
        return timing

    def cancel(self) -> None:
        """Cancel the request in flight from another thread: its ``request`` returns failed with CANCELLED."""
        self.client.cancel()

    def close(self) -> None:
        self.client.close()
