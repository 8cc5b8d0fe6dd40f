"""One short request through each served pipeline before ``serve`` says ready: the served path's first-use costs
(every stage's warm-up covers its own steps, not the hand-offs between the processes) are paid here, not by the
first user. On one H200 at full size, with every stage warmed up, the first spoken turn after start still took
1.4 s from the end of speech to its first audio and every later turn 0.1 s (benchmarks/results/h200-api)."""

from __future__ import annotations

import numpy as np

from omni_triton.launch.final_responses import RequestFailed, send_until_final

REQUEST_ID = "serve-first-request"


def first_request_inputs() -> dict[str, np.ndarray]:
    """A few thinker tokens and the first audio chunk's frames, greedy, whatever the model says."""
    return {"TEXT": np.array([b"Hello."], dtype=np.object_), "MAX_TOKENS": np.array([4], np.int32),
            "MIN_TOKENS": np.array([4], np.int32), "IGNORE_EOS": np.array([True]),
            "MAX_AUDIO_FRAMES": np.array([32], np.int32), "MIN_AUDIO_FRAMES": np.array([32], np.int32),
            "TEMPERATURE": np.array([0.0], np.float32)}


def send_first_requests(grpc_url: str, count: int = 1, model: str = "omni", timeout_s: float = 300.0) -> float:
    """``count`` requests at once (one per orchestrator instance: Triton hands requests to the free instances in
    turn), each to its final response; the seconds they took. Raises RuntimeError naming the error of one that
    failed."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in first_request_inputs().items():
        datatype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    request_ids = [f"{REQUEST_ID}-{index}" for index in range(count)]
    try:
        return send_until_final(grpc_url, model, inputs, request_ids, timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the first request was not answered in {timeout_s:.0f} s") from None
    except RequestFailed as error:
        raise RuntimeError(f"the first request failed: {error}") from None
