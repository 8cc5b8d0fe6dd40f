"""Per-request event times for latency breakdowns: off unless ``OMNI_TRITON_TRACE_DIR`` names a directory.

Every process of a deployment (each Triton stage's stub, the client, or one in-process pipeline) appends
JSON lines to ``<dir>/<pid>.jsonl``: ``{"id": request id, "event": name, "t": CLOCK_MONOTONIC seconds,
"pid": ...}``. CLOCK_MONOTONIC is one clock for every process of a machine, so events from different
stages of one request can be subtracted (``benchmarks/ttfa_breakdown.py`` does). Callers record only a
request's milestones up to its first audio (a few lines per request), so tracing does not change what it
measures; off, ``event`` costs one attribute test.

Event names are ``<where>.<what>``; the ids are the orchestrator's request ids (``<client id>#<n>``),
which the stages key their state on too.

Besides request events, a process may write *records* that belong to no request (``record``): the engines' step
log (``step``, one line per engine step, ``engine/step_log.py``), the code2wav stage's call log (``code2wav_call``,
one line per execute, ``stages/code2wav_call_log.py``) and the orchestrator's chunks (``code2wav_chunk``, one line
per code2wav request, ``pipeline/session.py``): ``{"record": kind, "t": ..., "pid": ..., **fields}``.
``read_events`` skips them; ``read_records`` and ``records_by_kind`` read them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

TRACE_DIR_ENV = "OMNI_TRITON_TRACE_DIR"


class _TraceLog:
    def __init__(self, directory: str | None):
        self.enabled = bool(directory)
        self._directory = Path(directory) if directory else None
        self._lock = threading.Lock()
        self._file = None

    def event(self, request_id: str, name: str, **fields) -> None:
        if self.enabled:
            self.write({"id": request_id, "event": name, "t": time.monotonic(), "pid": os.getpid(), **fields})

    def write(self, entry: dict) -> None:
        line = json.dumps(entry)
        with self._lock:
            if self._file is None:  # opened lazily: after Triton forked the stub, in the stub's own pid
                self._directory.mkdir(parents=True, exist_ok=True)
                self._file = open(self._directory / f"{os.getpid()}.jsonl", "a", buffering=1)
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


_log = _TraceLog(os.environ.get(TRACE_DIR_ENV))


def configure(directory: str | Path | None) -> None:
    """Trace this process into ``directory`` from now on (None: stop). Processes started later inherit the
    environment, not this: set ``TRACE_DIR_ENV`` for them."""
    global _log
    old, _log = _log, _TraceLog(str(directory) if directory else None)
    old.close()


@contextlib.contextmanager
def traced_into(directory: str | Path | None) -> Iterator[None]:
    """This process traced into ``directory`` inside the block (None: not traced there), not after it: one
    benchmark level's or rate's requests, not the warm-up's nor the next level's."""
    configure(directory)
    try:
        yield
    finally:
        configure(None)


def enabled() -> bool:
    return _log.enabled


def event(request_id: str, name: str, **fields) -> None:
    """Record ``name`` for ``request_id`` now (no-op when tracing is off)."""
    _log.event(request_id, name, **fields)


def record(kind: str, t: float, /, **fields) -> None:
    """A line of ``kind`` that belongs to no request, stamped ``t`` (CLOCK_MONOTONIC seconds; no-op when tracing
    is off)."""
    if _log.enabled:
        _log.write({"record": kind, "t": t, "pid": os.getpid(), **fields})


def _lines(directory: str | Path):
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def read_records(directory: str | Path, kind: str) -> list[dict]:
    """Every ``record`` of ``kind`` in ``directory`` (all processes), in time order."""
    return records_by_kind(directory).get(kind, [])


def records_by_kind(directory: str | Path) -> dict[str, list[dict]]:
    """``{kind: every record of that kind in directory, in time order}`` (one read of the files for all kinds)."""
    records: dict[str, list[dict]] = {}
    for entry in _lines(directory):
        if "record" in entry:
            records.setdefault(entry["record"], []).append(entry)
    return {kind: sorted(entries, key=lambda e: e["t"]) for kind, entries in records.items()}


def read_events(directory: str | Path) -> dict[str, dict[str, float]]:
    """``{request id: {event: earliest time}}`` from every process's file in ``directory``."""
    events: dict[str, dict[str, float]] = {}
    for entry in _lines(directory):
        if "id" in entry:
            per_request = events.setdefault(entry["id"], {})
            per_request[entry["event"]] = min(entry["t"], per_request.get(entry["event"], entry["t"]))
    return events
