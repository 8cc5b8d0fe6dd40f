import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when triton.language is
# first imported, and many test modules import it indirectly (through the engine and the model layers), so it
# is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests run from a checkout, installed or not
    sys.path.insert(0, str(ROOT))

if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter's per-call scan for the builtins to patch, over listed names (the same patches, a third
    # less interpreter time: tests/_interpreter_scan.py)
    import _interpreter_scan

    _interpreter_scan.install()

from omni_triton.shared.settings import STAGES, LaunchConfig  # noqa: E402

# Launch limits the server tests probe: small, so "too long" inputs stay cheap to send.
TEST_LIMITS = dict(max_text_chars=500, max_audio_seconds=3.0, max_tokens_cap=64, default_max_tokens=16,
                   kv_cache_tokens=512)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("checkpoint") / "tiny")


@pytest.fixture(scope="session")
def code2wav_onnx_export(tmp_path_factory):
    """(checkpoint, Code2Wav, ONNX path): a tiny checkpoint of its own with its Code2Wav gain calibrated (out of the
    clamp: tests/_code2wav_helpers.py) and saved back, so every backend runs the same model, and that model's ONNX
    export (dynamic batch and frames). Exported once for the session (several seconds): the ONNX tests and the
    served ``--code2wav-runtime onnx`` test share it."""
    from _code2wav_helpers import calibrate_output_gain_, overwrite_code2wav_weights
    from build_engines.export_code2wav_onnx import export_code2wav_onnx
    from omni_triton.checkpoints.tiny import build
    from omni_triton.models.weights import load_code2wav

    root = tmp_path_factory.mktemp("code2wav_onnx")
    checkpoint = build(root / "tiny", "tiny")
    model = calibrate_output_gain_(load_code2wav(checkpoint))
    overwrite_code2wav_weights(checkpoint, model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster on a shared 2-core machine
    try:
        return checkpoint, model, export_code2wav_onnx(model, root / "code2wav.onnx")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def triton_server(tiny_checkpoint, tmp_path_factory):
    """A real tritonserver serving every model template written so far, on the tiny checkpoint."""
    from server_fixture import start_server

    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          **TEST_LIMITS)
    handle = start_server(config, tmp_path_factory.mktemp("triton"))
    try:
        yield handle
    finally:
        handle.stop_after_tests()


@pytest.fixture
def traced(tmp_path):
    """Request traces (omni_triton.trace) of this process into a fresh dir (yielded), off again afterwards."""
    from omni_triton import trace

    trace.configure(tmp_path / "trace")
    yield tmp_path / "trace"
    trace.configure(None)
