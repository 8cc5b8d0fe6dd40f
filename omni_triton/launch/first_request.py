"""One short request through each served pipeline before ``serve`` says ready: the served path's first-use costs
(every stage's warm-up covers its own steps, not the hand-offs between the processes) are paid here, not by the
first user. On one H200 at full size, with every stage warmed up, the first spoken turn after start still took
1.4 s from the end of speech to its first audio and every later turn 0.1 s (benchmarks/results/h200-api)."""

from __future__ import annotations

import queue
import time

import numpy as np

REQUEST_ID = "serve-first-request"


def first_request_inputs() -> dict[str, np.ndarray]:
    """A few thinker tokens and the first audio chunk's frames, greedy, whatever the model says."""
    return {"TEXT": np.array([b"Hello."], dtype=np.object_), "MAX_TOKENS": np.array([4], np.int32),
            "MIN_TOKENS": np.array([4], np.int32), "IGNORE_EOS": np.array([True]),
            "MAX_AUDIO_FRAMES": np.array([32], np.int32), "MIN_AUDIO_FRAMES": np.array([32], np.int32),
            "TEMPERATURE": np.array([0.0], np.float32)}


def send_first_requests(grpc_url: str, count: int = 1, model: str = "omni", timeout_s: float = 300.0) -> float:
    """``count`` requests at once (one per pipeline: Triton hands requests to the free orchestrator instances, one
    per pipeline, in turn), each to its final response; the seconds they took. Raises RuntimeError naming the error of one that failed."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in first_request_inputs().items():
        datatype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    start = time.monotonic()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for index in range(count):
            client.async_stream_infer(model, inputs, request_id=f"{REQUEST_ID}-{index}",
                                      enable_empty_final_response=True)
        finished = 0
        while finished < count:
            left = timeout_s - (time.monotonic() - start)
            try:
                result, error = responses.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise RuntimeError(f"the first request was not answered in {timeout_s:.0f} s") from None
            if error is not None:
                raise RuntimeError(f"the first request failed: {error}")
            finished += result.get_response().parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return time.monotonic() - start
