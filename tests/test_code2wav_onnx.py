"""Code2Wav ONNX export (dynamic batch/frames) vs torch, and the runtime switch over its backends."""

from __future__ import annotations

import pytest
import torch

from _code2wav_helpers import one_torch_thread  # noqa: F401 (fixture)
from build_engines.build_code2wav_trt import build_engine, profile_shapes
from build_engines.build_code2wav_trt import main as build_trt_main
from build_engines.export_code2wav_onnx import (check_onnx, compare_streaming_with_torch, compare_with_torch,
                                                default_splits, export_streaming_onnx)
from omni_triton.models.code2wav.runtime import Code2WavRuntime, tensorrt_available
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exported(code2wav_onnx_export):
    """(checkpoint, calibrated Code2Wav, ONNX path): conftest's export."""
    return code2wav_onnx_export


def test_onnx_runtime_matches_torch(exported):
    _, model, onnx_path = exported
    check_onnx(onnx_path)
    window = model.sliding_window
    errors = compare_with_torch(onnx_path, model, [1, window - 1, window, window + 1, 2 * window + 6])
    assert max(errors.values()) <= 1e-4, errors


def test_runtime_switch_torch_equals_onnxruntime(exported):
    checkpoint, model, onnx_path = exported
    torch_runtime = Code2WavRuntime.create("torch", checkpoint)
    ort_runtime = Code2WavRuntime.create("onnxruntime", checkpoint, onnx_path=onnx_path)
    auto = Code2WavRuntime.create("auto", checkpoint, onnx_path=onnx_path, plan_path=onnx_path.with_suffix(".plan"))
    assert (torch_runtime.kind, ort_runtime.kind, auto.kind) == ("torch", "onnxruntime", "onnxruntime")
    codes = torch.randint(0, model.config.codebook_size, (3, model.num_quantizers, 30),
                          generator=torch.Generator().manual_seed(0))
    expected = torch_runtime.decode(codes)
    assert expected.shape == (3, torch_runtime.output_length(30))
    assert (ort_runtime.decode(codes) - expected).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="codes must be"):
        ort_runtime.decode(codes[:, :-1])


def test_runtime_rejects_unknown_kind_and_missing_files(exported):
    checkpoint, _, _ = exported
    with pytest.raises(ValueError, match="not one of"):
        Code2WavRuntime.create("tflite", checkpoint)
    with pytest.raises(ValueError, match="onnx_path"):
        Code2WavRuntime.create("onnxruntime", checkpoint, onnx_path=checkpoint / "missing.onnx")


@pytest.fixture(scope="module")
def exported_stateful(exported, tmp_path_factory):
    checkpoint, model, _ = exported
    return export_streaming_onnx(model, tmp_path_factory.mktemp("code2wav_onnx") / "code2wav_stateful.onnx")


def test_stateful_onnx_streams_the_one_pass_waveform(exported, exported_stateful):
    """ONNX Runtime, state fed back each call (ramp, 1-frame, ragged streams batched), vs torch's one pass."""
    _, model, _ = exported
    check_onnx(exported_stateful)
    errors = compare_streaming_with_torch(exported_stateful, model, default_splits())
    assert max(errors.values()) <= 1e-4, errors


def test_stateful_runtime_onnxruntime_equals_torch(exported, exported_stateful):
    checkpoint, model, _ = exported
    torch_runtime = Code2WavRuntime.create("torch", checkpoint)
    ort_runtime = Code2WavRuntime.create("onnxruntime", checkpoint, onnx_path=exported_stateful)
    assert torch_runtime.streams and ort_runtime.streams
    assert torch_runtime.state_specs() == ort_runtime.state_specs()
    codes = torch.randint(0, model.config.codebook_size, (2, model.num_quantizers, 9),
                          generator=torch.Generator().manual_seed(4))
    lengths, state = torch.tensor([9, 4]), torch_runtime.streaming.initial_state(2)
    for _ in range(2):  # a first chunk, then a later one from the state it returned
        expected, expected_state = torch_runtime.decode_stream(codes, lengths, state)
        actual, actual_state = ort_runtime.decode_stream(codes, lengths, state)
        assert (actual - expected).abs().max().item() <= 1e-4
        assert all((a.float() - e.float()).abs().max().item() <= 1e-4 for a, e in zip(actual_state, expected_state))
        state = expected_state
    with pytest.raises(ValueError, match="one-pass|decode_stream only"):
        ort_runtime.decode(codes)
    bad = list(state)
    bad[3] = bad[3][..., :-1]
    with pytest.raises(ValueError, match=f"streaming state '{torch_runtime.state_specs()[3].name}'"):
        ort_runtime.decode_stream(codes, lengths, bad)
    with pytest.raises(ValueError, match="streaming state has"):
        torch_runtime.decode_stream(codes, lengths, state[:-1])


@pytest.mark.skipif(tensorrt_available(), reason="tensorrt is importable here: the script would build")
def test_stateful_trt_profile_covers_every_input(exported, exported_stateful, capsys):
    """The build script takes the stateful export: its profile (and trtexec line) names every ONNX input."""
    import onnx

    checkpoint, _, _ = exported
    with pytest.raises(SystemExit):  # no tensorrt here: the script stops after printing the profile
        build_trt_main(["--onnx", str(exported_stateful), "--out", "unused.plan", "--checkpoint", str(checkpoint),
                        "--stateful"])
    printed = capsys.readouterr().out
    inputs = [i.name for i in onnx.load(str(exported_stateful), load_external_data=False).graph.input]
    assert all(f"profile for {name}:" in printed for name in inputs)
    assert all(f"{name}:" in printed.split("trtexec --onnx")[1] for name in inputs)


@pytest.mark.skipif(tensorrt_available(), reason="tensorrt is importable here")
def test_trt_builder_explains_missing_tensorrt(exported, tmp_path, capsys):
    checkpoint, _, onnx_path = exported
    with pytest.raises(SystemExit, match="tensorrt"):
        build_trt_main(["--onnx", str(onnx_path), "--out", str(tmp_path / "c.plan"), "--checkpoint", str(checkpoint)])
    assert "trtexec --onnx=" in capsys.readouterr().out


@pytest.mark.skipif(not tensorrt_available() or not torch.cuda.is_available(),
                    reason="needs the tensorrt Python package and a CUDA GPU")
def test_tensorrt_matches_torch(exported, tmp_path):
    checkpoint, model, onnx_path = exported
    policy = ChunkPolicy(4, 25, 30)
    shapes = profile_shapes(model.num_quantizers, policy, opt_batch=2, max_batch=4)
    plan = build_engine(onnx_path, tmp_path / "code2wav.plan", shapes, "fp32", workspace_mib=1024)
    trt_runtime = Code2WavRuntime.create("auto", checkpoint, onnx_path=onnx_path, plan_path=plan, device="cuda")
    assert trt_runtime.kind == "tensorrt"
    torch_runtime = Code2WavRuntime.create("torch", checkpoint, device="cuda")
    for num_frames in (1, 30, policy.max_frames_per_call()):
        codes = torch.randint(0, model.config.codebook_size, (2, model.num_quantizers, num_frames), device="cuda")
        assert (trt_runtime.decode(codes) - torch_runtime.decode(codes)).abs().max().item() <= 1e-3
