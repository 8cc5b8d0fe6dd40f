"""Work around a deadlock in the decoupled-BLS response iterator of the bundled Triton 2.51 stub.

The orchestrator reads several BLS response streams at once while it starts new ones. In the Python
backend stub of Triton 2.51 (the nvidia-pytriton 0.7.0 bundle, the embedded default) that can close a
lock cycle between the GIL and two of the stub's mutexes (``native/bls_iterator_lock_order.c`` says
which), after which the orchestrator stub answers nothing ever again: under 4 streams this happened
after 67 to ~900 requests (benchmarks/stub_workaround_soak.py). The fix is a small library preloaded
into tritonserver that changes the order in which ``ResponseIterator::Next`` takes the GIL and its mutex
back. It is built here, once, with the system C compiler, and only applied to the stub binaries of that
bundle (known by their SHA-256, wherever they were unpacked): another Triton build gets nothing preloaded.

``OMNI_TRITON_STUB_LOCK_FIX=0`` turns it off (e.g. to reproduce the deadlock). Built python_backend r26.07
has the same cycle; there ``build_engines/python_backend_patches/python_backend-bls-lock-order.patch`` fixes
it in the source instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "bls_iterator_lock_order.c"
NEXT_SYMBOL = "_ZN6triton7backend6python16ResponseIterator4NextEv"  # ResponseIterator::Next()


def lock_fix_environment(binary: bytes, cache_dir: Path) -> dict[str, str]:
    """LD_PRELOAD and the symbol range for the affected stub ``binary``; empty when the fix cannot apply."""
    if os.environ.get("OMNI_TRITON_STUB_LOCK_FIX", "1") == "0":
        return {}
    span = _symbol_range(binary, NEXT_SYMBOL)
    library = _build(cache_dir)
    if span is None or library is None:
        logger.warning("the Triton 2.51 stub deadlock fix is not applied (%s): concurrent streams can hang "
                       "the orchestrator", "no symbol table" if span is None else "no C compiler")
        return {}
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "OMNI_TRITON_STUB_NEXT_RANGE": f"{span[0]:x}:{span[1]:x}"}


def _symbol_range(elf: bytes, symbol: str) -> tuple[int, int] | None:
    """(offset, size) of a function in an x86-64 ELF binary's symbol table (what ``nm -S`` prints)."""
    if elf[:5] != b"\x7fELF\x02" or elf[5] != 1:  # 64-bit, little-endian
        return None
    section_table, entry_size, count = struct.unpack_from("<Q", elf, 0x28)[0], *struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, section_table + i * entry_size) for i in range(count)]
    wanted = symbol.encode()
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[link][4]
        for entry in range(offset, offset + size, 24):
            name, _, _, _, value, length = struct.unpack_from("<IBBHQQ", elf, entry)
            if elf[names + name:names + name + len(wanted) + 1] == wanted + b"\0":
                return value, length
    return None


def _build(cache_dir: Path) -> Path | None:
    """The preload library, compiled once per source version into ``cache_dir``."""
    source = SOURCE.read_bytes()
    library = cache_dir / f"bls_iterator_lock_order-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if library.is_file():
        return library
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        logger.warning("building %s failed: %s", SOURCE.name, result.stderr.strip()[-500:])
        return None
    partial.replace(library)  # atomic: concurrent launches never load a half-written library
    return library
