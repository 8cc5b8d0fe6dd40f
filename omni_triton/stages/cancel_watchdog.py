"""One thread that watches every running request of an orchestrator for its end: cancelled in Triton (the client
went away), by a control request or a drain (its flag), or past its deadline; it rings the request's ``Alarm``.
Stage deaths are rung here too (``ring_all``, called by the stage supervisor).

Each stream used to ask for itself, from every wait, every ``POLL_S``: three threads per stream woke 20 times a second
and most of the orchestrator's CPU under load went to those wake-ups. Here one thread asks for all of them on the same
beat, so a cancel is still seen within ``POLL_S``, and the sessions sleep until their alarm rings. It asks Triton's
``request.is_cancelled()`` (an IPC round trip on the request's own slot, unsafe to call concurrently) from this thread
only, and never after ``unwatch`` returned: past the request's final response that call crashes the server
(TRITONBACKEND_ResponseFactoryIsCancelled on a freed factory).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from omni_triton.pipeline.alarm import Alarm
from omni_triton.pipeline.session import POLL_S

logger = logging.getLogger(__name__)


@dataclass
class _Watch:
    request: Any  # has is_cancelled() (Triton's InferenceRequest)
    cancelled: threading.Event  # set by a control request or a drain; set here when Triton says cancelled
    deadline: float  # monotonic; math.inf: none
    alarm: Alarm


class CancelWatchdog:
    def __init__(self, poll_s: float = POLL_S):
        self._poll_s = poll_s
        self._lock = threading.Lock()  # held while Triton is asked: ``unwatch`` waits for a question in flight
        self._watches: dict[str, _Watch] = {}
        self._changed = threading.Condition(self._lock)  # a first watch came, or the watchdog stops
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="omni-cancel-watchdog", daemon=True)
        self._thread.start()

    def watch(self, request_id: str, request: Any, cancelled: threading.Event, deadline: float, alarm: Alarm) -> None:
        with self._lock:
            self._watches[request_id] = _Watch(request, cancelled, deadline, alarm)
            self._changed.notify_all()

    def unwatch(self, request_id: str) -> None:
        """After this returns ``request`` is not asked anything again."""
        with self._lock:
            self._watches.pop(request_id, None)

    def ring_all(self) -> None:
        """Every running request must look now (a stage died: its check tells whether that stage was its)."""
        with self._lock:
            alarms = [watch.alarm for watch in self._watches.values()]
        for alarm in alarms:
            alarm.ring()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                # idle without requests: no wake-ups while the server has nothing to do
                self._changed.wait_for(lambda: self._stopping or self._watches)
                if self._stopping:
                    return
            time.sleep(self._poll_s)
            try:
                self.look()
            except Exception:  # a dead watchdog would leave every cancel unseen
                logger.exception("cancel watchdog")

    def look(self) -> None:
        """One look at every watched request; rings the alarm of each that must end. It rings again at every look
        until the request is unwatched: a wait that began after a ring (a frame stream opened meanwhile) looks then."""
        ended: list[Alarm] = []
        with self._lock:
            now = time.monotonic()
            for watch in self._watches.values():
                if not watch.cancelled.is_set() and now <= watch.deadline and watch.request.is_cancelled():
                    watch.cancelled.set()
                if watch.cancelled.is_set() or now > watch.deadline:
                    ended.append(watch.alarm)
        for alarm in ended:  # outside the lock: a listener may take the session's own locks
            alarm.ring()
