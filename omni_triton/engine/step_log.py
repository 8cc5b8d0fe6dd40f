"""The engine's step log: one trace record per engine step (``trace.record("step", ...)``), written only while
tracing is on, so a trace says whether a stream waited on the GPU, the host, another process or its input.

A record (``engine``: "thinker" / "talker"; times in ms, ``t`` = the step's end, CLOCK_MONOTONIC seconds):
- ``kind``: decode (every row computes one token and samples), prefill (no such row), mixed (both);
- ``rows``, ``tokens`` (positions computed), ``prefill_tokens``, ``decode_rows``, ``sampled`` (tokens
  generated), ``completion_rows`` (rows whose stage completion ran: the talker's code predictor), ``graph``
  (the step replayed a CUDA graph: decode, or prefill/mixed), ``preempted``;
- ``ahead``: the step was launched by the previous step, before that one's tokens reached the host
  (``overlap.py``); ``not_ahead``: null when the next step is launched so, else why not (``overlap.NOT_AHEAD``,
  "stopped" when every row of the one launched stopped, "off" / "not_supported" without overlapped steps);
  ``left_out``: when it is launched so without some of this step's rows, their count by reason (``overlap.LEFT_OUT``:
  stopped, reaching max_new_tokens, waiting for input, a prefill going on), else null; ``joined``: rows not in this
  step that joined the one launched so (a talker row whose text came), else 0;
- ``host_ms``: the step's wall time on the engine thread; ``gpu_ms``: the GPU-stream span between events
  recorded at the step's start and end (CUDA only, else null; it includes the stream's idle gaps while the
  host launches, and time the GPU spent on other processes' work);
- ``cpu_ms``: the engine thread's CPU time during the step (``time.thread_time``): ``host_ms - cpu_ms`` is what
  the thread waited for inside the step (GPU syncs, the GIL held by the process's other threads);
  ``gc_ms``: garbage collections that ran on the engine thread during the step;
- ``gap_ms``: since the previous step's end (the loop applying commands, or waiting for any), and what filled
  it (``gap_ms``, ``gap_cpu_ms``, ``gap_gc_ms`` null on a process's first logged step): ``gap_cpu_ms`` and
  ``gap_gc_ms`` as above, the gap's; timed by ``EngineLoop`` (``BetweenSteps``; 0 for an engine stepped without
  it): ``gap_commands`` (commands applied: add, append, abort), ``gap_commands_ms`` (applying them, without the
  stats snapshot after each), ``gap_commands_by_kind`` ({kind: count}, kinds applied only), ``gap_stats_ms``
  (the ``stats()`` snapshots after the previous step and after each command), ``gap_outputs_ms`` (queueing the
  previous step's outputs for the response thread), ``gap_blocked_ms`` (waiting for a command, and for the GPU
  before it, with nothing to run); ``gap_log_ms``: this log writing the previous steps' records (tracing's own
  cost). The rest of ``gap_ms`` is the loop around them; ``gap_ms - gap_blocked_ms - gap_cpu_ms``: the thread
  off the CPU while it had work (the GIL held by the process's other threads: the response thread, Triton's
  request threads);
- queues at scheduling: ``waiting_input`` (rows holding KV but with no input to compute: a talker row waiting
  for thinker text), ``waiting`` (sequences queued for admission); after the step: ``left_runnable`` (rows
  that could run at once), ``left_waiting_input``, which say what the gap before the next step was.

No extra synchronisation: the CUDA events are read one step (or more) later, once ``Event.query()`` says they
completed, which the next step's own sync of the sampled ids guarantees; ``flush(wait=True)`` reads the rest
when the engine goes idle.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter, deque
from typing import Callable, NamedTuple

import torch

from omni_triton import trace

# the parts of the gap between steps that EngineLoop times (gap_<part>_ms), "log" timed by the step log itself
GAP_PARTS = ("commands", "stats", "outputs", "blocked", "log")


class BetweenSteps:
    """What the engine loop did since the last logged step's end, while tracing is on: the wall time of each part
    (``GAP_PARTS``) and the commands applied by kind. Only the engine thread touches it."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """(In place: EngineLoop holds it across the step that ends the gap.)"""
        self.ms = dict.fromkeys(GAP_PARTS, 0.0)
        self.commands: Counter[str] = Counter()

    def time(self, part: str, fn: Callable, *args):
        """``fn(*args)``, its wall time added to ``part`` (also when it raises: a command wait that timed out)."""
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.ms[part] += (time.monotonic() - t0) * 1e3

    def command(self, kind: str, fn: Callable, *args):
        self.commands[kind] += 1
        return self.time("commands", fn, *args)

    def fields(self) -> dict:
        return {"gap_commands": sum(self.commands.values()), "gap_commands_by_kind": dict(self.commands),
                **{f"gap_{part}_ms": round(ms, 3) for part, ms in self.ms.items()}}


class Untimed:
    """``BetweenSteps``' interface while tracing is off: calls only."""

    @staticmethod
    def time(part: str, fn: Callable, *args):
        return fn(*args)

    @staticmethod
    def command(kind: str, fn: Callable, *args):
        return fn(*args)


UNTIMED = Untimed()


class _Clocks(NamedTuple):
    t: float  # CLOCK_MONOTONIC s
    cpu: float  # the thread's CPU time, s
    gc_ms: float  # the thread's garbage collections so far

    @classmethod
    def now(cls) -> "_Clocks":
        return cls(time.monotonic(), time.thread_time(), thread_gc_ms())

    def since(self, earlier: "_Clocks") -> tuple[float, float, float]:
        """(wall, CPU, garbage collection) ms from ``earlier`` to these."""
        cpu_ms = round((self.cpu - earlier.cpu) * 1e3, 3)
        return (self.t - earlier.t) * 1e3, cpu_ms, round(self.gc_ms - earlier.gc_ms, 3)


class _Began(NamedTuple):
    clocks: _Clocks
    gap: dict  # the fields of the gap before the step
    event: torch.cuda.Event | None


class StepLog:
    def __init__(self, engine: str, device: torch.device):
        self.engine = engine
        self.device = device
        self.cuda = device.type == "cuda"
        self._unread: deque[tuple[dict, torch.cuda.Event, torch.cuda.Event]] = deque()  # GPU time not read yet
        self._last_end: _Clocks | None = None
        self.between = BetweenSteps()  # EngineLoop times the gap before the next step into it

    def begin(self) -> _Began:
        start_event = None
        if self.cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record(torch.cuda.current_stream(self.device))
        clocks = _Clocks.now()
        wall, cpu, gc_ms = (None, None, None) if self._last_end is None else clocks.since(self._last_end)
        # (not reset here: a step that runs nothing logs no end, and its gap goes on to the next step's)
        gap = {"gap_ms": wall, "gap_cpu_ms": cpu, "gap_gc_ms": gc_ms, **self.between.fields()}
        return _Began(clocks, gap, start_event)

    def end(self, began: _Began, **fields) -> None:
        clocks = _Clocks.now()
        host_ms, cpu_ms, gc_ms = clocks.since(began.clocks)
        entry = {"engine": self.engine, "host_ms": host_ms, "gpu_ms": None, "cpu_ms": cpu_ms, "gc_ms": gc_ms,
                 **began.gap, **fields}
        self._last_end = clocks
        self.between.reset()
        if began.event is None:
            trace.record("step", clocks.t, **entry)
        else:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record(torch.cuda.current_stream(self.device))
            self._unread.append((dict(entry, t=clocks.t), began.event, end_event))
            self.flush()
        self.between.ms["log"] += (time.monotonic() - clocks.t) * 1e3  # (after this step's end: the next gap's)

    def flush(self, wait: bool = False) -> None:
        """Write the records whose GPU events completed (``wait``: all of them, synchronising: when idle)."""
        while self._unread:
            entry, start_event, end_event = self._unread[0]
            if wait:
                end_event.synchronize()
            elif not end_event.query():
                return
            self._unread.popleft()
            t = entry.pop("t")
            trace.record("step", t, **{**entry, "gpu_ms": start_event.elapsed_time(end_event)})


# Garbage collection time per thread: gc.callbacks run on the thread whose allocation triggered the collection.
# Installed when a step is first logged (tracing on), kept after: a few calls per collection.
_gc_clock = threading.local()


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_clock.started = time.monotonic()
    elif getattr(_gc_clock, "started", None) is not None:
        _gc_clock.ms = getattr(_gc_clock, "ms", 0.0) + (time.monotonic() - _gc_clock.started) * 1e3
        _gc_clock.started = None


def thread_gc_ms() -> float:
    """Milliseconds this thread spent in garbage collection since the clock was installed (by the first call)."""
    if _time_gc not in gc.callbacks:
        gc.callbacks.append(_time_gc)
    return getattr(_gc_clock, "ms", 0.0)
