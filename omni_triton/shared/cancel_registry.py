"""Cancels that every orchestrator instance of one server sees (``serve --pipelines N``: one instance per pipeline,
or more with ``--instances orchestrator=K``).

A client cancels a request in flight with a control request carrying its request id (``orchestrator`` module
docstring). Triton hands that control request to any instance of the orchestrator model, not necessarily the one
that holds the request, so an instance that holds no request of that id records the cancel here, and every
instance looks here for the ids it holds each time its admission loop polls (every few tens of ms).

One entry per cancelled client id: a file in a directory of the server's own (``registry_dir``: named after the
tritonserver process, in /dev/shm where there is one, so the polls never touch a disk), holding when the cancel
arrived (``time.monotonic``: one clock for every process of the host). A cancel applies to the requests of its id
that had arrived by then, as with one orchestrator, never to one of the same id that arrives later. The instance
that applies an entry removes it, any instance removes the expired ones (a cancel whose request already ended, or
never came), and the last instance to stop removes the directory; the launcher removes what a crash left
(``TritonServer``).

A drain (``omni_triton.shared.drain``) reaches one instance too: it records here until when running sessions may
run (``record_drain``), every instance finds it at its next poll (``drain_until``) and, once it holds no session,
says so (``mark_drained``), so the instance that got the drain answers once every instance is done (``drained``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping

# Long enough for every instance to poll it even when a loaded orchestrator's loop runs late; only a bound on
# how long a cancel nobody holds stays (a later request of the same id is safe by time, not by expiry).
CANCEL_TTL_S = 10.0
_PREFIX = "omni-triton-cancels-"
_DRAIN = "drain"  # entries of a drain: "drain" (until when), "drained-<instance>" (that instance holds nothing)


def registry_dir(server_pid: int) -> Path:
    """The registry of the tritonserver with pid ``server_pid`` (its stubs' parent)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"{_PREFIX}{server_pid}"


def remove_registry(server_pid: int) -> None:
    """Remove a server's registry, whatever it still holds (the server is gone)."""
    shutil.rmtree(registry_dir(server_pid), ignore_errors=True)


def _entry(client_id: str) -> str:
    # a file name whatever the id holds (slashes, any length)
    return hashlib.sha256(client_id.encode()).hexdigest()[:32]


class CancelRegistry:
    def __init__(self, directory: Path, ttl_s: float = CANCEL_TTL_S):
        self.directory, self.ttl_s = Path(directory), ttl_s
        self.directory.mkdir(parents=True, exist_ok=True)

    def record(self, client_id: str, at: float | None = None) -> None:
        """A cancel of ``client_id`` arrived (at monotonic time ``at``, default now) that this instance could not
        apply itself."""
        self._write(_entry(client_id), time.monotonic() if at is None else at)

    def _write(self, name: str, at: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)  # the last instance to stop may have removed it
        partial = self.directory / f".{name}.{os.getpid()}"  # written whole, then renamed: never read half
        partial.write_text(repr(at))
        os.replace(partial, self.directory / name)

    def take(self, held: Mapping[str, float], now: float | None = None) -> dict[str, float]:
        """Of ``held`` (client id -> when its earliest request still held arrived), the ids a recorded cancel names
        that arrived at or before the cancel: id -> when the cancel arrived. Those entries are removed, and so are
        the expired ones."""
        now = time.monotonic() if now is None else now
        wanted = {_entry(client_id): client_id for client_id in held}
        taken = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return taken
        for entry in entries:
            if entry.name.startswith(_DRAIN):  # a drain's entries stay until the server is gone
                continue
            if entry.name.startswith("."):  # a write in progress, or one a killed process left half done
                if _age_s(entry) > self.ttl_s:
                    _unlink(entry.path)
                continue
            try:
                at = float(Path(entry.path).read_text())
            except (OSError, ValueError):
                continue  # removed meanwhile by another instance
            client_id = wanted.get(entry.name)
            if client_id is not None and held[client_id] <= at:
                taken[client_id] = at
                _unlink(entry.path)
            elif now - at > self.ttl_s:
                _unlink(entry.path)
        return taken

    def record_drain(self, until: float) -> None:
        """The server drains: sessions may run until monotonic time ``until``."""
        self._write(_DRAIN, until)

    def drain_until(self) -> float | None:
        """Until when sessions may run, once a drain was recorded (None: no drain)."""
        try:
            return float((self.directory / _DRAIN).read_text())
        except (OSError, ValueError):
            return None

    def mark_drained(self, instance: str) -> None:
        """The orchestrator instance ``instance`` (a name unique in the server) holds no session any more and
        takes none."""
        self._write(f"{_DRAIN}ed-{instance}", time.monotonic())

    def drained(self) -> int:
        """How many instances said they hold no session."""
        try:
            return sum(entry.name.startswith(f"{_DRAIN}ed-") for entry in os.scandir(self.directory))
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        """This instance stops: remove the directory when nothing is left in it (another instance still running
        recreates it when it records)."""
        self.take({})  # drop expired entries
        try:
            self.directory.rmdir()
        except OSError:  # another instance's entries: it, or the launcher, removes them
            pass


def _age_s(entry: os.DirEntry) -> float:
    """Seconds since ``entry`` was written (0 if it is gone)."""
    try:
        return time.time() - entry.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
