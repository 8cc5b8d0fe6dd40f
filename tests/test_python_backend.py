"""The Python backend built from source (``omni-triton build python-backend``): chosen, clean, and what CI runs.

CI (and the README's test command) builds it in scripts/setup.sh, so the whole suite runs on it; the
bundled backend keeps its own module (test_bundled_backend.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from build_engines import python_backend as builder
from omni_triton.client import OmniStreamClient
from omni_triton.shared import bundled_backend
from omni_triton.launch.python_backend import BACKEND_FILES, BUILD_INFO, load_built_backend
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.launch.tritonserver import TritonServerError, find_tritonserver

THIRD_PARTY = Path(__file__).resolve().parents[2] / "shared" / "third_party"
SHUTDOWN_ALARMS = ("Fatal Python error", "Segmentation fault", "Exit timeout expired", "Aborted")


def _fake_build(directory: Path, **info) -> Path:
    python_dir = directory / "python"
    python_dir.mkdir(parents=True)
    for name in BACKEND_FILES:
        (python_dir / name).write_text("")
    (python_dir / BUILD_INFO).write_text(json.dumps(info))
    return directory


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI must run on the built backend; elsewhere optional")
def test_ci_serves_every_test_with_the_built_backend():
    built, why_not = load_built_backend()
    assert built is not None, why_not
    install = find_tritonserver()
    assert install.python_backend == "built" and install.backend_dir == built.directory


def test_an_unusable_build_is_named_with_the_reason(tmp_path, monkeypatch):
    built, why_not = load_built_backend(tmp_path / "nothing")
    assert built is None and "missing libtriton_python.so" in why_not
    other_python = _fake_build(tmp_path / "py27", python="2.7", gpu=False)
    built, why_not = load_built_backend(other_python)
    assert built is None and "built for Python 2.7" in why_not and "omni-triton build python-backend" in why_not
    monkeypatch.setenv("OMNI_TRITON_PYTHON_BACKEND_DIR", str(tmp_path / "nothing"))
    with pytest.raises(TritonServerError, match="--python-backend built: no built Python backend"):
        find_tritonserver(python_backend="built")
    assert find_tritonserver(python_backend="auto").python_backend == "bundled"


def test_a_cpu_only_build_is_not_chosen_for_cuda(tmp_path, monkeypatch):
    import sys

    cpu_build = _fake_build(tmp_path / "cpu", python=f"{sys.version_info.major}.{sys.version_info.minor}", gpu=False)
    monkeypatch.setenv("OMNI_TRITON_PYTHON_BACKEND_DIR", str(cpu_build))
    assert find_tritonserver(device="cpu").python_backend == "built"
    install = find_tritonserver(device="cuda")
    assert install.python_backend == "bundled" and "rebuild with --gpu" in install.python_backend_note


def test_a_matching_build_is_not_repeated(tmp_path):
    wanted = builder.wanted_info(gpu=False, build_type="Release")
    assert not builder.up_to_date(tmp_path, wanted)
    _fake_build(tmp_path, **wanted)
    assert builder.up_to_date(tmp_path, wanted)
    assert not builder.up_to_date(tmp_path, builder.wanted_info(gpu=True, build_type="Release"))


def test_missing_tools_are_named_with_where_they_come_from(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.setattr(builder.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(builder.BuildError, match=r"cmake >= 3\.31\.8 is needed .*pip install 'cmake>=3\.31\.8'"):
        builder.find_cmake()
    with pytest.raises(builder.BuildError, match="no C\\+\\+ compiler"):
        builder.find_compiler()


@pytest.mark.skipif(not THIRD_PARTY.is_dir(), reason="the pinned source tarballs are not beside this checkout")
def test_our_patches_apply_to_the_pinned_sources(tmp_path):
    src = builder.fetch_sources(THIRD_PARTY, tmp_path)
    patched = (src / "python_backend" / "src" / "pb_response_iterator.cc").read_text()
    assert "give the GIL up before taking mu_" in patched
    # python_backend-dead-stub-requests.patch, applied after it and before the ones that touch other files
    assert "ModelInstanceState::StubExited()" in (src / "python_backend" / "src" / "python_be.cc").read_text()
    assert "TRITON_COMMON_ENABLE_TESTS" in (src / "common" / "src" / "CMakeLists.txt").read_text()


@pytest.mark.server
def test_the_built_backend_serves_without_workarounds_and_stops_cleanly(tiny_checkpoint, tmp_path):
    """No preloaded library, no iterator retirement; a stop after streaming is graceful (every model unloads after SIGINT, no escalation) and logs no crash."""
    built, why_not = load_built_backend()
    if built is None:
        pytest.skip(why_not)
    from conftest import TEST_LIMITS
    from server_fixture import start_server

    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          **TEST_LIMITS)
    handle = start_server(config, tmp_path, python_backend="built")
    try:
        env = handle.server.install.environment()
        assert bundled_backend.SWITCH not in env and "LD_PRELOAD" not in handle.server.install.stub_fixes
        stubs = handle.server.stub_pids()
        for pid in stubs.values():
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"{bundled_backend.SWITCH}=1".encode() not in environ
        with OmniStreamClient(handle.grpc_url) as client:
            result = client.stream("a clean stop", temperature=0.0, max_tokens=4, max_audio_frames=8)
        assert result.audio_seconds > 0
    finally:
        started = time.monotonic()
        handle.server.stop()
        stop_s = time.monotonic() - started
    log = handle.server.log_path.read_text(errors="replace")
    alarms = [line for line in log.splitlines() if any(alarm in line for alarm in SHUTDOWN_ALARMS)]
    assert not alarms, f"shutdown logged: {alarms[:5]}"
    # graceful: every model unloaded after SIGINT (a stop that needed SIGTERM/SIGKILL hung somewhere); how long
    # that takes depends on the machine's load, so it is printed, not bounded
    print(f"\nstop: {handle.server.stop_outcome} in {stop_s:.1f} s")
    assert handle.server.stop_outcome == "graceful", f"stop {handle.server.stop_outcome} after {stop_s:.1f} s"
    leftover = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub.*{handle.server.shm_prefix}"],
                              capture_output=True, text=True).stdout.split()
    assert not leftover, f"stub processes left: {leftover}"
