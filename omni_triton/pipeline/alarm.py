"""A session's alarm: rung when something may have happened that stops the request (a cancel, its deadline, a stage
that died, its own audio path failing), so that its waits sleep until then instead of looking up every ``POLL_S``.

Each wake-up was cheap, but a stream waited in three threads at once (thinker loop, frame reader, request thread),
each waking every 50 ms: under load most of the orchestrator's CPU went to those wake-ups, not to its work. A ring
says only "look now": the woken wait runs its usual check, which decides; a ring that concerns another stage costs
one check. Whoever rings (the orchestrator's cancel watchdog, the stage supervisor) does so from its own thread.
"""

from __future__ import annotations

import threading
from typing import Callable


class Alarm:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[int, Callable[[], None]] = {}
        self._next_key = 0

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (from the ringing thread; it must not block) at every ring until the returned
        function is called."""
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            self._listeners[key] = listener

        def unsubscribe() -> None:
            with self._lock:
                self._listeners.pop(key, None)

        return unsubscribe

    def ring(self) -> None:
        with self._lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            listener()
