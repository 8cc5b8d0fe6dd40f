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
- ``gap_ms``: since the previous step's end (the loop applying commands, or waiting for any);
- queues at scheduling: ``waiting_input`` (rows holding KV but with no input to compute: a talker row waiting
  for thinker text), ``waiting`` (sequences queued for admission); after the step: ``left_runnable`` (rows
  that could run at once), ``left_waiting_input``, which say what the gap before the next step was.

No extra synchronisation: the CUDA events are read one step (or more) later, once ``Event.query()`` says they
completed, which the next step's own sync of the sampled ids guarantees; ``flush(wait=True)`` reads the rest
when the engine goes idle.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from omni_triton import trace


class StepLog:
    def __init__(self, engine: str, device: torch.device):
        self.engine = engine
        self.device = device
        self.cuda = device.type == "cuda"
        self._unread: deque[tuple[dict, torch.cuda.Event, torch.cuda.Event]] = deque()  # GPU time not read yet
        self._last_end: float | None = None

    def begin(self) -> tuple[float, torch.cuda.Event | None]:
        start_event = None
        if self.cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record(torch.cuda.current_stream(self.device))
        return time.monotonic(), start_event

    def end(self, began: tuple[float, torch.cuda.Event | None], **fields) -> None:
        t_start, start_event = began
        t_end = time.monotonic()
        entry = {"engine": self.engine, "host_ms": (t_end - t_start) * 1e3,
                 "gap_ms": None if self._last_end is None else (t_start - self._last_end) * 1e3,
                 "gpu_ms": None, **fields}
        self._last_end = t_end
        if start_event is None:
            trace.record("step", t_end, **entry)
            return
        end_event = torch.cuda.Event(enable_timing=True)
        end_event.record(torch.cuda.current_stream(self.device))
        self._unread.append((dict(entry, t=t_end), start_event, end_event))
        self.flush()

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
