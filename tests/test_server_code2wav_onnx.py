"""`--code2wav-runtime onnx` end to end: the exported ONNX vocoder served by Triton matches torch in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from omni_triton.shared.settings import STAGES, LaunchConfig
from test_server_basic import infer_one

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def vocoder(code2wav_onnx_export):
    torch.set_num_threads(1)
    return code2wav_onnx_export[1]


@pytest.fixture(scope="module")
def onnx_server(code2wav_onnx_export, tmp_path_factory):
    from server_fixture import start_server

    checkpoint, _, onnx_path = code2wav_onnx_export  # the ONNX tests' export: the same vocoder, one export
    run_dir = tmp_path_factory.mktemp("code2wav_onnx")
    config = LaunchConfig(checkpoint_dir=checkpoint, code2wav_runtime="onnx", code2wav_engine_path=onnx_path,
                          left_context_frames="exact",  # a one-pass ONNX file: stateless chunks
                          torch_threads={stage: 1 for stage in STAGES})
    handle = start_server(config, run_dir, models=["code2wav"])
    try:
        yield handle
    finally:
        handle.stop_after_tests()


def test_onnx_code2wav_over_triton_matches_torch(onnx_server, vocoder):
    codes = np.random.default_rng(3).integers(0, vocoder.config.codebook_size, (1, vocoder.num_quantizers, 10))
    with torch.inference_mode():
        expected = vocoder(torch.from_numpy(codes))[0].numpy()
    inputs = [grpcclient.InferInput("CODES", list(codes.shape), "INT64"),
              grpcclient.InferInput("LEFT_CONTEXT", [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(codes)
    for left_context in (0, 4):
        inputs[1].set_data_from_numpy(np.array([[left_context]], np.int32))
        with onnx_server.grpc_client() as client:
            audio = infer_one(client, "code2wav", inputs).as_numpy("AUDIO")[0]
        start = left_context * vocoder.samples_per_frame - vocoder.trim_samples if left_context else 0
        # the exporter accepts ONNX Runtime within 1e-3 of torch (its --tolerance default)
        np.testing.assert_allclose(audio, expected[start:], atol=1e-3)
