"""The OpenAI-compatible API (``omni-triton api``): streamed chat completions with audio over HTTP (SSE), one
HTTP connection per worker. Timed as the gRPC runner times the server it fronts: arrival of each text delta
and each audio chunk at the client."""

from __future__ import annotations

import base64
import json
import time

import numpy as np

from omni_triton.bench.metrics import RequestTiming


def chat_body(tensors: dict[str, np.ndarray], model: str = "omni") -> dict:
    """The ``omni`` client tensors as a streamed chat completion: the scalars go by their lowercase names (the
    API's fields and extensions are named so), TEXT becomes the user message."""
    values = {name: value.reshape(-1)[0] for name, value in tensors.items()}
    if values.pop("SEQUENTIAL", False):
        raise ValueError("the API has no SEQUENTIAL mode")
    text = values.pop("TEXT").decode("utf-8")
    speaker = values.pop("SPEAKER", None)
    wants_audio = bool(values.pop("RETURN_AUDIO", True))
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "modalities": ["text", "audio"] if wants_audio else ["text"]}
    if wants_audio:
        body["audio"] = {"format": "pcm16", "voice": speaker.decode() if speaker is not None else None}
    body.update({name.lower(): value.item() for name, value in values.items()})
    return body


class OpenAIApiRunner:
    name = "api"
    sequential = False
    max_concurrency = None

    def __init__(self, url: str, *, model: str = "omni", timeout_s: float = 600.0):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s

    def open_worker(self) -> "OpenAIApiWorker":
        return OpenAIApiWorker(self.url, self.model, self.timeout_s)

    def close(self) -> None:
        pass


class OpenAIApiWorker:
    def __init__(self, url: str, model: str, timeout_s: float):
        import httpx

        self.url, self.model = url, model
        self.http = httpx.Client(timeout=timeout_s)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        timing = RequestTiming()
        body = chat_body(tensors, self.model)
        start = time.perf_counter()
        try:
            with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self._record(json.loads(line[len("data: "):]), timing, time.perf_counter() - start)
        except Exception as error:  # a failed request is a result to report, not a crash of the benchmark
            timing.error = timing.error or f"{type(error).__name__}: {error}"
        timing.total_s = time.perf_counter() - start
        return timing

    @staticmethod
    def _record(event: dict, timing: RequestTiming, now: float) -> None:
        if "error" in event:
            raise RuntimeError(event["error"].get("message"))
        for choice in event.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("content"):
                timing.text_times.append(now)
            data = (delta.get("audio") or {}).get("data")
            if data:
                timing.audio_chunks.append((now, len(base64.b64decode(data)) // 2))

    def close(self) -> None:
        self.http.close()
