"""Every workaround for the Python backend bundled with nvidia-pytriton 0.7.0 (Triton 2.51), behind one switch.

That backend has four defects that the served pipeline meets (upstream fixed them in python_backend r26.07,
which ``omni-triton build python-backend`` builds; ``omni_triton/launch/python_backend.py``):

| defect of the 2.51 backend | upstream fix | what this package does |
| --- | --- | --- |
| ``ResponseIterator::Next`` lock-order deadlock (the orchestrator stub wedges) | none yet (our patch: ``python_backend-bls-lock-order.patch``) | ``lock_fix``: a preloaded library reorders the GIL and the iterator mutex |
| BLS iterators freed without the GIL (heap corruption, stub segfault) | #433, #439 | ``iterator_retirement``: Python keeps the last reference |
| CUDA tensors through short decoupled BLS calls hang or abort | #439 | tensors between stages go through host memory (``interstage_memory``) |
| race on the parent's decoupled-BLS payload map (segfault at 8 GPU streams) | #398 | none possible from Python: use the built backend on a GPU |

The switch: the server's stub is one of the known 2.51 stub binaries (``AFFECTED_STUBS``, by SHA-256). The
launcher then sets ``OMNI_TRITON_BUNDLED_BACKEND=1`` in the server's environment, which the stage models
read through ``active()``. With any other backend (built, or a newer Triton's) nothing here is applied.
Dropping the bundled backend later means deleting this package and its few call sites.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from omni_triton.shared.bundled_backend.iterator_retirement import IteratorRetirement
from omni_triton.shared.bundled_backend.lock_fix import lock_fix_environment

SWITCH = "OMNI_TRITON_BUNDLED_BACKEND"
# The Python-backend stubs of nvidia-pytriton 0.7.0 (Triton 2.51), one per Python version: the binaries whose
# defects were found and whose ResponseIterator::Next was read for the preloaded fix.
AFFECTED_STUBS = {
    "41c352e7eae5ea1b3e6474a679180b770911dedef5fa836a9457f1e8601cf412",  # Python 3.8
    "cf800e6d53a69556848dd95af0e591fff4e6ab848903454f6d5448185f328aad",  # Python 3.9
    "251c532e0af9c057d50784cc933fd52f304163e238d51e74c0ffc1c1790188b5",  # Python 3.10
    "a302adf6396501ac139da06f965aea1bf61929c99bf799f6b8797e071cd268f4",  # Python 3.11
    "41a7758c6f44520b846e90a5bf8b063f99aee01698c3e32113ce352fe8369921",  # Python 3.12
    "7b701b4b4bc01ca7af0350eaffa4f2aed92f02b465b3494a265059e4d3ca6cf8",  # Python 3.13
}


def _stub_bytes(stub: Path) -> bytes:
    try:
        return stub.read_bytes()
    except OSError:
        return b""


def is_bundled_stub(stub: Path) -> bool:
    """Whether ``stub`` is one of the 2.51 stub binaries these workarounds are for."""
    return hashlib.sha256(_stub_bytes(stub)).hexdigest() in AFFECTED_STUBS


def server_environment(stub: Path, cache_dir: Path) -> dict[str, str]:
    """What tritonserver's environment needs for the stub it will launch: nothing unless it is a 2.51 stub."""
    binary = _stub_bytes(stub)
    if hashlib.sha256(binary).hexdigest() not in AFFECTED_STUBS:
        return {}
    return {SWITCH: "1", **lock_fix_environment(binary, cache_dir)}


def active() -> bool:
    """Inside a stub process: whether it runs the bundled 2.51 backend (set by server_environment)."""
    return os.environ.get(SWITCH) == "1"


def interstage_memory(stub: Path, device: str) -> str:
    """Default for ``--interstage-memory``: host where the 2.51 backend would have to pass CUDA tensors
    through decoupled BLS (it hangs), device everywhere else."""
    return "host" if device == "cuda" and is_bundled_stub(stub) else "device"


@functools.cache
def _retirement() -> IteratorRetirement:
    return IteratorRetirement()


def release_iterator(iterator: Any) -> None:
    """A finished BLS response iterator: kept a while on the 2.51 backend (see iterator_retirement), else
    dropped by the caller as usual."""
    if active():
        _retirement().retire(iterator)
