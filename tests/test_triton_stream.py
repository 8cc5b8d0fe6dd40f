"""The API's request builder (``api.triton_stream``): the tensors Triton receives are tritonclient's own, and the
request asks for the empty final response on every tritonclient version (newer ones refuse ``triton_``
parameters passed through their aio client, which gRPC reported as a cancelled call)."""

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor

from omni_triton.api.triton_stream import EMPTY_FINAL_RESPONSE, infer_request
from omni_triton.client import infer_inputs, request_arrays


def test_request_carries_tritonclients_tensors_and_asks_for_the_final_response():
    arrays = request_arrays("héllo", np.linspace(-1, 1, 7, dtype=np.float32), max_tokens=5, speaker="Ethan",
                            seed=3, return_audio=True)
    request = infer_request("omni", arrays, "req-1")
    assert request.model_name == "omni" and request.id == "req-1"
    assert request.parameters[EMPTY_FINAL_RESPONSE].bool_param is True
    expected = infer_inputs(arrays)  # what tritonclient's own InferInput puts on the wire
    assert [tensor.name for tensor in request.inputs] == [tensor.name() for tensor in expected]
    for tensor, content, reference in zip(request.inputs, request.raw_input_contents, expected):
        assert tensor.datatype == reference.datatype() and list(tensor.shape) == reference.shape()
        assert content == reference._get_content(), tensor.name


def test_bytes_and_numbers_read_back():
    arrays = {"TEXT": np.array(["a longer text".encode()], dtype=np.object_), "SEED": np.array([7], np.int64),
              "EMPTY": np.zeros((1, 0), np.float32)}
    request = infer_request("orchestrator", arrays, "r")
    text, seed, empty = request.raw_input_contents
    assert deserialize_bytes_tensor(text).tolist() == [b"a longer text"]
    assert np.frombuffer(seed, np.int64).tolist() == [7] and empty == b""
    assert [t.datatype for t in request.inputs] == ["BYTES", "INT64", "FP32"]
