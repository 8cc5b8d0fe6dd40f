"""The Python backend bundled with nvidia-pytriton (Triton 2.51), kept honest while it is supported.

The default suite runs on the Python backend built from source (test_python_backend.py). This module serves
the pipeline on the bundled backend, with its workarounds (omni_triton/shared/bundled_backend/), and checks
what those workarounds set up. That they are needed was measured by benchmarks/stub_workaround_soak.py:
without either one the orchestrator stub crashed or wedged within a few dozen to a few hundred requests at
4 streams.
"""

from __future__ import annotations

import gc
import subprocess
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_triton.client import OmniStreamClient
from omni_triton.shared import bundled_backend
from omni_triton.shared.bundled_backend import iterator_retirement
from omni_triton.shared.bundled_backend.lock_fix import NEXT_SYMBOL, lock_fix_environment
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.launch.tritonserver import STUB_NAME, find_tritonserver

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def install():
    install = find_tritonserver(python_backend="bundled")
    if not bundled_backend.is_bundled_stub(install.stub):
        pytest.skip("the workarounds only apply to the nvidia-pytriton 0.7.0 bundle")
    return install


def test_the_bundled_server_gets_the_workarounds_switched_on(install):
    env = install.environment()
    assert env[bundled_backend.SWITCH] == "1"
    assert install.interstage_memory("cuda") == "host" and install.interstage_memory("cpu") == "device"
    library = env["LD_PRELOAD"].split()[0]
    offset, size = (int(part, 16) for part in env["OMNI_TRITON_STUB_NEXT_RANGE"].split(":"))
    # the library exports the two functions it interposes
    symbols = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True).stdout
    assert "PyEval_RestoreThread" in symbols and "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE" in symbols
    # the range is ResponseIterator::Next of the very stub the server launches, which waits through libstdc++
    listing = subprocess.run(["nm", "-S", str(install.stub)], capture_output=True, text=True).stdout
    assert f"{offset:016x} {size:016x} t {NEXT_SYMBOL}" in listing


def test_the_lock_fix_applies_to_the_affected_stub_only_and_can_be_turned_off(install, tmp_path, monkeypatch):
    stub = install.stub
    monkeypatch.setenv("OMNI_TRITON_STUB_LOCK_FIX", "0")
    assert lock_fix_environment(stub.read_bytes(), tmp_path) == {}
    monkeypatch.delenv("OMNI_TRITON_STUB_LOCK_FIX")
    assert bundled_backend.server_environment(stub, tmp_path)["OMNI_TRITON_STUB_NEXT_RANGE"]
    other_build = tmp_path / STUB_NAME
    other_build.write_bytes(stub.read_bytes() + b"\0")  # any other binary: nothing at all is switched on
    assert bundled_backend.server_environment(other_build, tmp_path) == {}
    assert bundled_backend.interstage_memory(other_build, "cuda") == "device"


class _Iterator:
    """Stands in for a BLS response iterator (only its lifetime matters here)."""


def test_finished_iterators_outlive_their_stream_by_the_retirement_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(iterator_retirement.time, "monotonic", lambda: clock[0])
    retirement = iterator_retirement.IteratorRetirement()
    first = _Iterator()
    first_ref = weakref.ref(first)
    retirement.retire(first)
    del first
    clock[0] += iterator_retirement.RETIREMENT_S / 2
    retirement.retire(_Iterator())
    gc.collect()
    assert first_ref() is not None and len(retirement) == 2, "dropped before its retirement time"
    clock[0] += iterator_retirement.RETIREMENT_S
    retirement.retire(_Iterator())
    gc.collect()
    assert first_ref() is None and len(retirement) == 1, "kept past its retirement time"


def test_iterators_are_retired_only_with_the_switch_on(monkeypatch):
    kept = _Iterator()
    ref = weakref.ref(kept)
    monkeypatch.delenv(bundled_backend.SWITCH, raising=False)
    bundled_backend.release_iterator(kept)
    del kept
    gc.collect()
    assert ref() is None, "retired although the built backend needs no retirement"
    monkeypatch.setenv(bundled_backend.SWITCH, "1")
    kept = _Iterator()
    ref = weakref.ref(kept)
    bundled_backend.release_iterator(kept)
    del kept
    gc.collect()
    assert ref() is not None


def test_the_pipeline_streams_on_the_bundled_backend(install, tiny_checkpoint, tmp_path):
    """4 concurrent greedy streams over the bundled backend, each equal to the same request alone."""
    from conftest import TEST_LIMITS
    from server_fixture import start_server

    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          **TEST_LIMITS)
    handle = start_server(config, tmp_path, python_backend="bundled")
    try:
        assert handle.server.install.python_backend == "bundled"
        workload = dict(temperature=0.0, max_tokens=6, max_audio_frames=12)

        def stream(index: int):
            with OmniStreamClient(handle.grpc_url) as client:
                return client.stream(f"bundled backend request {index}", **workload)

        alone = stream(0)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(stream, [0, 0, 1, 2]))
        assert alone.text and alone.audio_seconds > 0
        for result in together[:2]:
            assert result.text == alone.text and len(result.audio) == len(alone.audio)
        assert all(result.audio_seconds > 0 for result in together)
    finally:
        handle.server.stop()
