"""Where a stage's load goes: the phases of its initialize, timed, and one line for the server log.

A stage's reload after its process died (``--allow-stage-reload``) is on a request path: the stage refuses work
until it is back. The line says which phase to shorten: the stub process's own start (interpreter, imports) before
``initialize`` ran, then each phase the stage marks (weights, the engine's KV cache and graphs, the warm-up).
Torch-free, so anything may import it."""

from __future__ import annotations

import os
import time
from typing import Callable


def process_age_s(pid: int | str = "self") -> float | None:
    """Seconds since the process started (Linux /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in clock ticks after boot
    return max(up - started, 0.0)


class LoadTimeline:
    """``mark(phase)`` after each phase; ``report()`` logs "<stage>: loaded in T s (a X s, b Y s, ...)" and how
    long the process had been up when the timeline began (its start and imports)."""

    def __init__(self, stage: str, log: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.stage = stage
        self.log = log
        self.started_after_s = process_age_s()
        self._start = self._last = time.monotonic()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self._last))
        self._last = now

    @property
    def total_s(self) -> float:
        return self._last - self._start

    def line(self) -> str:
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        before = ("" if self.started_after_s is None
                  else f"; the process was up {self.started_after_s:.1f} s before (its start, imports)")
        return f"{self.stage}: loaded in {self.total_s:.1f} s ({phases}){before}"

    def report(self) -> None:
        self.log(self.line())
