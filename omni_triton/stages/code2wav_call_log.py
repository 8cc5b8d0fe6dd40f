"""The code2wav stage's call log: one trace record per ``execute`` (``trace.record("code2wav_call", ...)``), written
only while tracing is on, so a trace says whether code2wav is bound by its GPU, by calls too small to fill it
(many calls of a chunk or two), or by requests waiting to reach it.

A record (times in ms; ``t`` = the execute's end, CLOCK_MONOTONIC seconds):
- ``requests`` (in the call, stream ends and rejected ones included), ``chunks`` (decoded: the batch's rows),
  ``frames_max`` (the longest chunk's frames: every row is padded to it), ``frames_total`` (frames decoded, left
  context included), ``new_frames`` (frames whose audio went out);
- ``waited_ms``: from the orchestrator's send of the call's oldest request to this execute (the BLS hop,
  Triton's queue and the hand-off to this stub; the orchestrator stamps its code2wav requests with their send
  time while it traces, ``send_stamp``); null when no request of the call carries a stamp;
- ``gap_ms``: since the previous execute returned (Triton's batcher gathering the next batch, or no request);
- ``host_ms``: the execute's wall time (it returns once the decode is done on the GPU; with --code2wav-overlap on,
  once the previous call's is), of which ``inputs_ms``
  before the decode (parsing the requests, copying and checking their CODES) and ``decode_host_ms`` in it (on a
  GPU: launching it; on the CPU: all of it); the rest is the wait for the GPU and the bookkeeping after;
- ``gpu_ms``: the decode's span on the GPU stream (CUDA events around it; null on the CPU);
- ``send_queued_ms``: from the execute's end until the sending thread took up the call's responses (it was still
  sending an earlier call's), ``send_ms``: from then (or from the execute's end, if it took them up earlier and
  waited for the decode) until they were all exported and sent (``deferred_sends``); both null if never sent.

No extra synchronisation: a record is written once its responses are out and its GPU end event has completed
(``Event.query()``), by the sending thread or at the next call, and the rest when the stage stops.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from omni_triton import trace

SENT_PARAMETER = "omni_trace_sent_ns"  # request parameter: CLOCK_MONOTONIC ns at the orchestrator's send


def send_stamp() -> dict[str, int]:
    """The parameters of a code2wav request that tell the stage when it was sent (none while tracing is off)."""
    return {SENT_PARAMETER: time.monotonic_ns()} if trace.enabled() else {}


def _sent_s(request: Any) -> float | None:
    try:
        stamp = json.loads(request.parameters() or "{}").get(SENT_PARAMETER)
    except (AttributeError, ValueError):  # a request with no parameters to read
        return None
    return None if stamp is None else stamp / 1e9


@dataclass
class Code2WavCall:
    began: float
    fields: dict = field(default_factory=dict)
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    t: float | None = None  # the execute's end; None until ``Code2WavCallLog.end``
    sent: tuple[float, float] | None = None  # when the sending thread took up the responses, and finished


class Code2WavCallLog:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._device = device
        self._lock = threading.Lock()  # the execute thread and the sending thread both write
        self._unwritten: deque[Code2WavCall] = deque()  # in execute order, which is the order they are sent in
        self._last_end: float | None = None

    def begin(self, requests: list) -> Code2WavCall | None:
        """At the start of ``execute``; None while tracing is off (every other method then does nothing)."""
        if not trace.enabled():
            return None
        now = time.monotonic()
        self._write_ready()
        sent = [s for s in map(_sent_s, requests) if s is not None]
        return Code2WavCall(now, {
            "requests": len(requests),
            "waited_ms": (now - min(sent)) * 1e3 if sent else None,
            "gap_ms": None if self._last_end is None else (now - self._last_end) * 1e3,
            "inputs_ms": None, "decode_host_ms": None})

    @contextmanager
    def decoding(self, call: Code2WavCall | None) -> Iterator[None]:
        """Inside: the call's decode (its span on the current stream is the record's ``gpu_ms``)."""
        if call is None:
            yield
            return
        entered = time.monotonic()
        call.fields["inputs_ms"] = (entered - call.began) * 1e3
        if self.cuda:
            stream = torch.cuda.current_stream(self._device)
            call.start_event = torch.cuda.Event(enable_timing=True)
            call.start_event.record(stream)
        try:
            yield
        finally:
            if self.cuda:
                call.end_event = torch.cuda.Event(enable_timing=True)
                call.end_event.record(stream)
            call.fields["decode_host_ms"] = (time.monotonic() - entered) * 1e3

    def when_sent(self, call: Code2WavCall | None) -> Callable[[float, float], None] | None:
        """What the sending thread calls with (started, ended) once the call's responses are out (None while not
        tracing)."""
        return None if call is None else lambda started, ended: self._sent(call, started, ended)

    def end(self, call: Code2WavCall | None, frames: list[tuple[int, int]]) -> None:
        """At the end of ``execute``; ``frames``: (frames decoded, new frames) per chunk of the call."""
        if call is None:
            return
        call.t = self._last_end = time.monotonic()
        call.fields.update(chunks=len(frames), frames_max=max((n for n, _ in frames), default=0),
                           frames_total=sum(n for n, _ in frames), new_frames=sum(new for _, new in frames),
                           host_ms=(call.t - call.began) * 1e3)
        with self._lock:
            self._unwritten.append(call)
        self._write_ready()

    def close(self) -> None:
        """Write every record left, waiting for its GPU events (when the stage stops)."""
        self._write_ready(wait=True)

    def _sent(self, call: Code2WavCall, started: float, ended: float) -> None:
        call.sent = (started, ended)  # may come before ``end``: the responses go out once the GPU is done
        self._write_ready()

    def _write_ready(self, wait: bool = False) -> None:
        with self._lock:
            while self._unwritten:
                call = self._unwritten[0]
                if not (call.sent or wait):
                    return
                if call.end_event is not None:
                    if wait:
                        call.end_event.synchronize()
                    elif not call.end_event.query():
                        return
                self._unwritten.popleft()
                trace.record("code2wav_call", call.t, **call.fields, **_send_fields(call.t, call.sent),
                             gpu_ms=call.start_event.elapsed_time(call.end_event) if call.end_event is not None else None)


def _send_fields(t: float, sent: tuple[float, float] | None) -> dict:
    """The send's times from the execute's end ``t``: queued until the sending thread took the responses up, then
    sending them (counted from ``t`` when it took them up earlier: it exports them once the decode is done, which
    is also when the execute returns)."""
    if sent is None:
        return {"send_queued_ms": None, "send_ms": None}
    started, ended = sent
    return {"send_queued_ms": max(0.0, started - t) * 1e3, "send_ms": max(0.0, ended - max(started, t)) * 1e3}
