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

from omni_triton.shared.settings import STAGES, LaunchConfig  # noqa: E402

# Launch limits the server tests probe: small, so "too long" inputs stay cheap to send.
TEST_LIMITS = dict(max_text_chars=500, max_audio_seconds=3.0, max_tokens_cap=64, default_max_tokens=16,
                   kv_cache_tokens=512)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("checkpoint") / "tiny")


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
        handle.server.stop()


@pytest.fixture
def traced(tmp_path):
    """Request traces (omni_triton.trace) of this process into a fresh dir (yielded), off again afterwards."""
    from omni_triton import trace

    trace.configure(tmp_path / "trace")
    yield tmp_path / "trace"
    trace.configure(None)
