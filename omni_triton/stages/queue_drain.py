"""How fast the admission queue drains: starts out of it per second while it holds requests, learned online.

``Admission`` refuses at once a request whose expected wait for a start is too long (``admission_max_queue_wait``):
a request that queues behind ``ahead`` others starts after ``ahead + 1`` starts out of the queue, so it expects to
wait ``(ahead + 1) / rate``. The rate is measured, not modelled: starts out of the queue over the seconds the queue
held requests. While requests wait, starts are paced by the server alone (a stream ending, a start finishing, the
capacity estimate freeing a slot), whichever limit binds; while it is empty they follow the arrivals and say
nothing about the server, so that time is not counted. A model of the same rate from stream lifetimes (running /
lifetime) was the other choice, and it is wrong exactly where this bound matters: a burst's queue first drains at
the pace of staggered starts (``admission_max_starting``: a start is over at its first audio, in well under a
second), then at the pace of streams ending, and streams started together end together, so running / lifetime
would refuse the first part's quick waits and admit the second's long ones.

Smoothed per start, not per second (each start weighs ``1 - 1/MEMORY_STARTS`` of the one after it), so that a slow
queue (one start in tens of seconds) is judged on as many starts as a fast one; the seconds since the last start
count too, so a queue that stopped moving reads as slow before its next start. Before ``MIN_STARTS`` starts out of
the queue were seen (a cold server, or one that never queued) it knows nothing and ``per_second`` is None: the
bound is then off. Pure logic: times come in as arguments; the caller serializes calls (``Admission``'s lock).
"""

from __future__ import annotations

# starts remembered: at the ~2 starts/s of an H200 instance under a burst, the last ~4 s (adapts within a burst as
# the pace moves from staggered starts to streams ending, yet one uneven gap moves it by 1/8 only)
MEMORY_STARTS = 8
# starts out of the queue before the rate is trusted: one gap alone may be a stream that happened to end just
# after the queue formed (or long after)
MIN_STARTS = 2


class QueueDrain:
    def __init__(self, memory_starts: int = MEMORY_STARTS, min_starts: int = MIN_STARTS):
        if memory_starts < 1 or min_starts < 1:
            raise ValueError(f"memory_starts and min_starts must be >= 1, got {memory_starts}, {min_starts}")
        self.min_starts = min_starts
        self._keep = 1 - 1 / memory_starts  # the weight of a start (and its gap) per start after it
        self._starts = 0.0       # starts out of the queue, weighted
        self._seconds = 0.0      # the seconds the queue held requests before each of them, weighted alike
        self._open_s = 0.0       # seconds the queue held requests since its last start
        self._seen = 0           # starts out of the queue, in all
        self._mark: float | None = None  # counted up to here, and the queue held requests since (None: empty)

    def update(self, now: float, waiting: bool, started: int = 0) -> None:
        """At ``now``: ``started`` requests started out of the queue, which holds requests after them or not
        (``waiting``)."""
        if self._mark is not None:  # callers' clocks are read before the lock: one may be behind the last
            self._open_s += max(0.0, now - self._mark)
            now = max(now, self._mark)
        for _ in range(started):  # several at once share the gap before them: the rate of k in one gap is k / gap
            self._starts = self._starts * self._keep + 1
            self._seconds = self._seconds * self._keep + self._open_s / started
        if started:
            self._open_s = 0.0
        self._seen += started
        self._mark = now if waiting else None

    def emptied(self) -> None:
        """The queue emptied at a time not given (requests dropped): the time since the last update is not counted
        (time missed only makes the queue look faster: no request is refused for time that was not seen)."""
        self._mark = None

    def per_second(self) -> float | None:
        """Starts out of the queue per second while it holds requests (None: not learned yet)."""
        seconds = self._seconds + self._open_s
        if self._seen < self.min_starts or seconds <= 0:  # starts with no time between them tell no pace either
            return None
        return self._starts / seconds

    def wait_s(self, ahead: int) -> float | None:
        """Expected seconds until a request queued behind ``ahead`` others starts (None: not learned yet)."""
        rate = self.per_second()
        return None if rate is None else (ahead + 1) / rate
