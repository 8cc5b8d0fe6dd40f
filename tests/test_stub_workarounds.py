"""The workarounds for the bundled Triton 2.51 Python-backend stub (no server: what they set up).

That they work is shown by the served tests (the soak in test_reliability.py: 4 streams for a minute, zero
errors) and measured by benchmarks/stub_workaround_soak.py: without either one the orchestrator stub
crashed or wedged within a few dozen to a few hundred requests at 4 streams.
"""

from __future__ import annotations

import gc
import subprocess
import weakref

import pytest

from omni_triton.server import bls_clients
from omni_triton.server.stub_lock_fix import NEXT_SYMBOL, lock_fix_environment
from omni_triton.server.tritonserver import STUB_NAME, find_tritonserver


@pytest.fixture(scope="module")
def install():
    install = find_tritonserver()
    if install.origin != "pytriton":
        pytest.skip("the workaround only applies to the nvidia-pytriton bundle")
    return install


def test_the_bundled_server_gets_the_lock_order_fix_preloaded(install):
    env = install.environment()
    library = env["LD_PRELOAD"].split()[0]
    offset, size = (int(part, 16) for part in env["OMNI_TRITON_STUB_NEXT_RANGE"].split(":"))
    # the library exports the two functions it interposes
    symbols = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True).stdout
    assert "PyEval_RestoreThread" in symbols and "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE" in symbols
    # the range is ResponseIterator::Next of the very stub the server launches, which waits through libstdc++
    listing = subprocess.run(["nm", "-S", str(install.backend_dir / "python" / STUB_NAME)], capture_output=True,
                             text=True).stdout
    assert f"{offset:016x} {size:016x} t {NEXT_SYMBOL}" in listing


def test_the_fix_applies_to_the_affected_stub_only_and_can_be_turned_off(install, tmp_path, monkeypatch):
    stub = install.backend_dir / "python" / STUB_NAME
    monkeypatch.setenv("OMNI_TRITON_STUB_LOCK_FIX", "0")
    assert lock_fix_environment(stub, tmp_path) == {}
    monkeypatch.delenv("OMNI_TRITON_STUB_LOCK_FIX")
    assert lock_fix_environment(stub, tmp_path)["OMNI_TRITON_STUB_NEXT_RANGE"]
    other_build = tmp_path / STUB_NAME
    other_build.write_bytes(stub.read_bytes() + b"\0")  # any other binary: nothing is preloaded
    assert lock_fix_environment(other_build, tmp_path) == {}


class _Iterator:
    """Stands in for a BLS response iterator (only its lifetime matters here)."""


def test_finished_iterators_outlive_their_stream_by_the_retirement_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(bls_clients.time, "monotonic", lambda: clock[0])
    retirement = bls_clients._IteratorRetirement()
    first = _Iterator()
    first_ref = weakref.ref(first)
    retirement.retire(first)
    del first
    clock[0] += bls_clients.ITERATOR_RETIREMENT_S / 2
    retirement.retire(_Iterator())
    gc.collect()
    assert first_ref() is not None and len(retirement) == 2, "dropped before its retirement time"
    clock[0] += bls_clients.ITERATOR_RETIREMENT_S
    retirement.retire(_Iterator())
    gc.collect()
    assert first_ref() is None and len(retirement) == 1, "kept past its retirement time"


def test_no_retirement_time_drops_iterators_at_once(monkeypatch):
    monkeypatch.setattr(bls_clients, "ITERATOR_RETIREMENT_S", 0.0)
    retirement = bls_clients._IteratorRetirement()
    retirement.retire(_Iterator())
    retirement.retire(_Iterator())
    assert len(retirement) == 0
