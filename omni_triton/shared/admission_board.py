"""Whether the orchestrator would refuse a new request now, for the preprocess stage to refuse it first.

The ``omni`` ensemble runs preprocess (validation, chat template, tokens, audio features) before the orchestrator
sees a request, and the orchestrator takes requests from one Python thread whose GIL its streams' threads share:
under load a request it refuses waited for both (an H200 burst: refusals answered up to ~200 ms after they were
sent, later than the admitted streams' first audio). So each orchestrator instance publishes here, whenever its
admission changes, whether it would refuse a new request and the refusal naming the limit; preprocess reads that
before any of its work and refuses at once with the same UNAVAILABLE when every instance of the server would.
The orchestrator still decides: a request preprocess lets through may be refused there (its state changed in
between), never the other way round, and an instance that has not published (starting) or whose process is
gone (killed: the record of a dead stub is not read until its reload writes a fresh one) counts as one that would
take the request.

One small file per instance (``<pipeline>.<instance>``) in /dev/shm where there is one (``board_path``: named
after the tritonserver process, the stubs' parent): a flag byte and the message. Its writer holds a shared
``flock`` on it while it lives (the kernel drops it when the process ends, however it ends), so a reader that can
take the lock exclusively knows the record is a dead process's. The instance removes its file
when it stops; the launcher removes what a crash left (``remove_boards``).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

_PREFIX = "omni-triton-admission-"
RECORD_BYTES = 512  # the flag byte, then the message (UTF-8, cut to fit, zero-padded)


def _base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def board_path(server_pid: int, instance: str) -> Path:
    """The record of orchestrator ``instance`` ("<pipeline>.<instance>") of the tritonserver ``server_pid``."""
    return _base() / f"{_PREFIX}{server_pid}-{instance}"


def instance_names(pipelines: int, per_pipeline: int) -> list[str]:
    """Every orchestrator instance of a server of ``pipelines`` pipelines, ``per_pipeline`` instances each."""
    return [f"{pipeline}.{index}" for pipeline in range(pipelines) for index in range(per_pipeline)]


def remove_boards(server_pid: int) -> None:
    """Remove every record of a server's instances (the server is gone)."""
    for path in _base().glob(f"{_PREFIX}{server_pid}-*"):
        path.unlink(missing_ok=True)


def encode(refusal: str | None) -> bytes:
    """The record of an instance that would refuse with ``refusal`` (None: that would take a new request)."""
    if refusal is None:
        return bytes(RECORD_BYTES)
    message = refusal.encode()[:RECORD_BYTES - 1].decode(errors="ignore").encode()  # whole characters only
    return (b"\x01" + message).ljust(RECORD_BYTES, b"\x00")


def decode(record: bytes) -> str | None:
    """The refusal in ``record`` (None: the instance would take a new request, or the record is not whole)."""
    if len(record) != RECORD_BYTES or record[0] != 1:
        return None
    return record[1:].rstrip(b"\x00").decode(errors="replace")


class BoardWriter:
    """An orchestrator instance's record (one writer: calls are serialized by the caller)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # alive while held (readers: _written_by_the_living)
        self._last: bytes | None = None
        self.publish(None)

    def publish(self, refusal: str | None) -> None:
        record = encode(refusal)
        if record != self._last:  # one write per change, not per event
            os.pwrite(self._fd, record, 0)
            self._last = record

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


def refusal_of_all(paths: list[Path]) -> str | None:
    """The first instance's refusal when every instance in ``paths`` would refuse a new request, else None."""
    refusals = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # not published (yet): it may take the request
            return None
        try:
            refusal = decode(os.pread(fd, RECORD_BYTES, 0)) if _written_by_the_living(fd) else None
        finally:
            os.close(fd)
        if refusal is None:
            return None
        refusals.append(refusal)
    return refusals[0] if refusals else None


def _written_by_the_living(fd: int) -> bool:
    """Whether the record's writer still holds its lock (a process that ended dropped it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
