"""Whether the orchestrator would refuse a new request now, for the preprocess stage to refuse it first.

The ``omni`` ensemble runs preprocess (validation, chat template, tokens, audio features) before the orchestrator
sees a request, and the orchestrator takes requests from one Python thread whose GIL its streams' threads share:
under load a request it refuses waited for both (an H200 burst: refusals answered up to ~200 ms after they were
sent, later than the admitted streams' first audio). So each orchestrator instance publishes here, whenever its
admission changes, its outlook: how many more requests it would take (start or queue) before refusing one, the
refusal naming the limit it would answer then, and the mark of the latest request it received. Preprocess reads
that before any of its work and refuses at once with the same UNAVAILABLE when the instances' room is used up,
counting against it the requests it let through that no instance has received yet (``EarlyRefusal``): in a burst
those are on their way through the ensemble and the orchestrator's busy thread, and each would otherwise pass on a
stale outlook only to be refused there, late (an H200 burst at 4x goodput: 320 ms). The orchestrator still decides:
a request preprocess lets through may be refused there (its state changed in between), never the other way round,
and an instance that has not published (starting) or whose process is gone (killed: the record of a dead stub is
not read until its reload writes a fresh one) counts as one that would take the request.

What is counted can only be too low, never stay too high (too high refuses what the server has room for):
- only requests of the ``omni`` ensemble: preprocess marks each it lets through with the time it did
  (``LET_THROUGH_NS``, the host's monotonic clock, the same in every process), which the ensemble hands to the
  orchestrator. A client calling preprocess itself never reaches an orchestrator, and is told apart by what it
  asks for (``on_its_way``): by default every output, ``DIRECT_CALL`` included, which the ensemble does not map.
- each such request stops counting once an instance has received it or any request let through after it (the
  ensemble passes them on in order), so one that never arrives (cancelled on the way, failed, its instance killed
  or reloaded) is forgotten at the next arrival, and ``TRANSIT_S`` after it was let through at the latest. A request
  that arrives at an instance counts as received whatever follows (started, queued, refused, failed). With several
  instances one may receive a later request before another receives an earlier one: that one is no longer counted
  while still on its way, and the orchestrator refuses it if it must, as before the board.

One small file per instance (``<pipeline>.<instance>``) in /dev/shm where there is one (``board_path``: named
after the tritonserver process, the stubs' parent): a header (a version byte, the room, the mark of the latest
request received) and the message. Its writer holds a shared ``flock`` on it while it lives (the kernel drops it when
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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "omni-triton-admission-"
RECORD_BYTES = 512  # the header, then the message (UTF-8, cut to fit, zero-padded)
_HEADER = struct.Struct("<BIQ")  # version, room, the latest received request's LET_THROUGH_NS
_VERSION = 3
# a request let through longer ago than this and not received by any instance, nor any after it, is taken as lost:
# far longer than a busy ensemble holds one (an H200 burst: 320 ms; a stopped orchestrator in a test, a loaded CPU's
# preprocess), and only lost ones that fill the whole room (cancelled on the way together, nothing arriving after)
# keep refusing until then; an instance killed does not (a dead record is not read)
TRANSIT_S = 5.0
# the preprocess output that carries the mark to the orchestrator, and the one that only a direct call asks for
LET_THROUGH = "LET_THROUGH_NS"
DIRECT_CALL = "DIRECT_CALL"


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
    latest: int     # LET_THROUGH_NS of the latest request it received (0: none since its process started)


def encode(outlook: Outlook) -> bytes:
    message = outlook.refusal.encode()[:RECORD_BYTES - _HEADER.size]
    message = message.decode(errors="ignore").encode()  # whole characters only
    header = _HEADER.pack(_VERSION, outlook.room, outlook.latest)
    return (header + message).ljust(RECORD_BYTES, b"\x00")


def decode(record: bytes) -> Outlook | None:
    """The outlook in ``record`` (None: the record is not whole)."""
    if len(record) != RECORD_BYTES or record[0] != _VERSION:
        return None
    _, room, latest = _HEADER.unpack_from(record)
    return Outlook(room, record[_HEADER.size:].rstrip(b"\x00").decode(errors="replace"), latest)


class BoardWriter:
    """An orchestrator instance's record (one writer: calls are serialized by the caller)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # alive while held (readers: _written_by_the_living)
        self._last: bytes | None = None

    def publish(self, room: int, refusal: str, latest: int) -> None:
        """``room`` more requests would start or wait before one is refused with ``refusal``; ``latest``: the
        ``LET_THROUGH_NS`` of the latest request received."""
        record = encode(Outlook(room, refusal, latest))
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


def on_its_way(requested_outputs: Iterable[str]) -> bool:
    """Whether a preprocess request asking for ``requested_outputs`` goes on to an orchestrator: the ensemble asks
    for the mark and never for ``DIRECT_CALL``; a direct call asks for every output unless it names some, and one
    that names the mark without ``DIRECT_CALL`` says it hands the request on (counted: if it does not, the next
    arrival or ``TRANSIT_S`` ends it)."""
    requested = set(requested_outputs)
    return LET_THROUGH in requested and DIRECT_CALL not in requested


class EarlyRefusal:
    """Preprocess's side of the board (one caller: preprocess takes its requests one at a time): whether a request
    arriving now is refused before any work, counting the requests let through that no instance has received."""

    def __init__(self, paths: list[Path], transit_s: float = TRANSIT_S, clock=time.monotonic_ns):
        self.paths, self._transit_ns, self._clock = paths, int(transit_s * 1e9), clock
        self._on_their_way: deque[int] = deque()  # the marks of the requests let through, in order

    @property
    def in_transit(self) -> int:
        return len(self._on_their_way)

    def refusal(self) -> str | None:
        """The refusal naming the limit when the instances' room is taken by the requests on their way, else
        None (the orchestrator decides)."""
        outlooks = [read_outlook(path) for path in self.paths]
        self._forget_arrived(max((outlook.latest for outlook in outlooks if outlook is not None), default=0))
        if not outlooks or any(outlook is None for outlook in outlooks):
            return None  # an instance starting or reloading may take it
        if sum(outlook.room for outlook in outlooks) > self.in_transit:
            return None
        full = [outlook for outlook in outlooks if outlook.room == 0] or outlooks
        return full[0].refusal

    def let_through(self) -> int:
        """A request goes on to the orchestrator: its mark (``LET_THROUGH_NS``), counted until an instance has
        received it or one after it."""
        mark = self._clock()
        if self._on_their_way and mark <= self._on_their_way[-1]:
            mark = self._on_their_way[-1] + 1  # strictly increasing: a mark received stands for those before it
        self._on_their_way.append(mark)
        return mark

    def _forget_arrived(self, latest: int) -> None:
        """Drop the marks up to the latest received (arrived, or lost on the way) and those too old to arrive."""
        oldest = max(latest + 1, self._clock() - self._transit_ns)
        while self._on_their_way and self._on_their_way[0] < oldest:
            self._on_their_way.popleft()


def _written_by_the_living(fd: int) -> bool:
    """Whether the record's writer still holds its lock (a process that ended dropped it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
