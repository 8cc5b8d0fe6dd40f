"""Whether the orchestrator would refuse a new request now, for the preprocess stage to refuse it first.

The ``omni`` ensemble runs preprocess (validation, chat template, tokens, audio features) before the orchestrator
sees a request, and the orchestrator takes requests from one Python thread whose GIL its streams' threads share:
under load a request it refuses waited for both (an H200 burst: refusals answered up to ~200 ms after they were
sent, later than the admitted streams' first audio). So each orchestrator instance publishes here, whenever its
admission changes, its outlook: how many more requests it would take (start or queue) before refusing one, the
refusal naming the limit it would answer then, and how many requests it has received. Preprocess reads that before
any of its work and refuses at once with the same UNAVAILABLE when the instances' room is used up, counting
against it the requests it let through that no instance has received yet (``EarlyRefusal``): in a burst those are
on their way through the ensemble and the orchestrator's busy thread, and each would otherwise pass on a stale
outlook only to be refused there, late (an H200 burst at 4x goodput: 320 ms). The orchestrator still decides: a
request preprocess lets through may be refused there (its state changed in between), never the other way round,
and an instance that has not published (starting) or whose process is gone (killed: the record of a dead stub is
not read until its reload writes a fresh one) counts as one that would take the request. A request let through
that never reaches an instance (cancelled on the way, or its instance killed) stops counting ``TRANSIT_S`` after.

One small file per instance (``<pipeline>.<instance>``) in /dev/shm where there is one (``board_path``: named
after the tritonserver process, the stubs' parent): a header (a version byte, the room, the requests received, the
writer's pid) and the message. Its writer holds a shared ``flock`` on it while it lives (the kernel drops it when
the process ends, however it ends), so a reader that can take the lock exclusively knows the record is a dead
process's. The instance removes its file when it stops; the launcher removes what a crash left (``remove_boards``).
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "omni-triton-admission-"
RECORD_BYTES = 512  # the header, then the message (UTF-8, cut to fit, zero-padded)
_HEADER = struct.Struct("<BIQI")  # version, room, requests received, writer's pid
_VERSION = 2
# a request let through longer ago than this and not received by any instance is taken as lost (cancelled on its
# way, its instance killed): far longer than a busy ensemble holds one, short enough that a lost one does not keep
# a server that has room refusing
TRANSIT_S = 5.0


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


@dataclass(frozen=True)
class Outlook:
    """What one orchestrator instance published."""

    room: int       # requests arriving now it would still start or queue before refusing one
    refusal: str    # what it answers once that room is used up, naming the limit
    received: int   # requests it has received since its process started
    writer: int     # that process's id: a reloaded instance counts from 0 again


def encode(outlook: Outlook) -> bytes:
    message = outlook.refusal.encode()[:RECORD_BYTES - _HEADER.size]
    message = message.decode(errors="ignore").encode()  # whole characters only
    header = _HEADER.pack(_VERSION, outlook.room, outlook.received, outlook.writer)
    return (header + message).ljust(RECORD_BYTES, b"\x00")


def decode(record: bytes) -> Outlook | None:
    """The outlook in ``record`` (None: the record is not whole)."""
    if len(record) != RECORD_BYTES or record[0] != _VERSION:
        return None
    _, room, received, writer = _HEADER.unpack_from(record)
    return Outlook(room, record[_HEADER.size:].rstrip(b"\x00").decode(errors="replace"), received, writer)


class BoardWriter:
    """An orchestrator instance's record (one writer: calls are serialized by the caller)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # alive while held (readers: _written_by_the_living)
        self._last: bytes | None = None

    def publish(self, room: int, refusal: str, received: int) -> None:
        """``room`` more requests would start or wait before one is refused with ``refusal``; ``received``
        requests came since this process started."""
        record = encode(Outlook(room, refusal, received, os.getpid()))
        if record != self._last:  # one write per change, not per event
            os.pwrite(self._fd, record, 0)
            self._last = record

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


def read_outlook(path: Path) -> Outlook | None:
    """The outlook of the instance at ``path`` (None: not published, not whole, or its process is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # not published (yet)
        return None
    try:
        return decode(os.pread(fd, RECORD_BYTES, 0)) if _written_by_the_living(fd) else None
    finally:
        os.close(fd)


class EarlyRefusal:
    """Preprocess's side of the board (one caller: preprocess takes its requests one at a time): whether a request
    arriving now is refused before any work, counting the requests let through that no instance has received."""

    def __init__(self, paths: list[Path], transit_s: float = TRANSIT_S, clock=time.monotonic):
        self.paths, self.transit_s, self._clock = paths, transit_s, clock
        self._seen: dict[Path, tuple[int, int]] = {}  # record -> (writer, received) at the last look
        self._passed: deque[float] = deque()  # when each request still possibly on its way was let through
        self.in_transit = 0

    def refusal(self) -> str | None:
        """The refusal naming the limit when the instances' room is taken by the requests on their way, else
        None (the orchestrator decides)."""
        outlooks = [read_outlook(path) for path in self.paths]
        self._count_received(outlooks)
        if not outlooks or any(outlook is None for outlook in outlooks):
            return None  # an instance starting or reloading may take it
        if sum(outlook.room for outlook in outlooks) > self.in_transit:
            return None
        full = [outlook for outlook in outlooks if outlook.room == 0] or outlooks
        return full[0].refusal

    def let_through(self) -> None:
        """A request goes on to the orchestrator: it takes a place until an instance has received it."""
        self._passed.append(self._clock())
        self.in_transit += 1

    def _count_received(self, outlooks: list[Outlook | None]) -> None:
        for path, outlook in zip(self.paths, outlooks):
            if outlook is None:
                continue
            writer, received = self._seen.get(path, (outlook.writer, outlook.received))  # the first look: a baseline
            if writer != outlook.writer:  # a reloaded instance counts from 0
                received = 0
            self.in_transit = max(0, self.in_transit - max(0, outlook.received - received))
            self._seen[path] = (outlook.writer, outlook.received)
        too_old = self._clock() - self.transit_s
        while self._passed and self._passed[0] < too_old:
            self._passed.popleft()
        self.in_transit = min(self.in_transit, len(self._passed))  # never received: lost on the way


def _written_by_the_living(fd: int) -> bool:
    """Whether the record's writer still holds its lock (a process that ended dropped it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
