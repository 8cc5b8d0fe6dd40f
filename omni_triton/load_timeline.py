"""Where a stage's load goes: the phases of its initialize, timed, and one line for the server log.

A stage's reload after its process died (``--allow-stage-reload``) is on a request path: the stage refuses work
until it is back. The line says which phase to shorten: the stub process's own start (interpreter, imports) before
``initialize`` ran, then each phase the stage marks (weights, the engine's KV cache and graphs, the warm-up). The
stage supervisor's line at a reload (``reload_line``) has what comes around it: when the death was seen, when the
load was asked for, when Triton had the stage loaded. Torch-free, so anything may import it."""

from __future__ import annotations

import os
import re
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


# The stage supervisor's line once it reloaded a stage whose process died, and its reading by the bench: the steps
# of the outage before the new stub's own start (its load timeline above), in time since the kill.
RELOADED = re.compile(r"(?P<stage>\S+) stage reloaded in [0-9.]+ s: its death seen at unix time (?P<seen_at>[0-9.]+)"
                      r"(?: \(alive at the look [0-9.]+ s before\))?, the load request sent (?P<sent_s>[0-9.]+) s "
                      r"after, Triton loaded it (?P<load_s>[0-9.]+) s after that")


def reload_line(stage: str, seen_dead_at: float, alive_before_s: float | None, sent_after_s: float,
                load_s: float) -> str:
    """``seen_dead_at``: the unix time the watcher saw the stage's stub dead; ``alive_before_s``: how long before
    that its look saw it alive (the death fell in between; None: never seen alive); ``sent_after_s``: when the load
    request went out after that (the served config read first); ``load_s``: how long Triton took to answer it."""
    alive = "" if alive_before_s is None else f" (alive at the look {alive_before_s:.2f} s before)"
    return (f"{stage} stage reloaded in {sent_after_s + load_s:.1f} s: its death seen at unix time "
            f"{seen_dead_at:.3f}{alive}, the load request sent {sent_after_s:.2f} s after, Triton loaded it "
            f"{load_s:.2f} s after that")


def reload_steps(line: str, killed_at: float) -> dict | None:
    """From a ``reload_line`` in a log line: when each step came, in seconds after ``killed_at`` (the unix time of the
    kill, on the same host): {"stage", "death_seen_s", "load_sent_s", "loaded_s"}; None for any other line."""
    found = RELOADED.search(line)
    if found is None:
        return None
    seen = float(found["seen_at"]) - killed_at
    sent = seen + float(found["sent_s"])
    return {"stage": found["stage"], "death_seen_s": round(seen, 3), "load_sent_s": round(sent, 3),
            "loaded_s": round(sent + float(found["load_s"]), 3)}
