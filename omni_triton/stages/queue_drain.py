"""How long a request that queues for admission expects to wait: measured from the queue's drain, else a prior.

``Admission`` refuses at once a request whose expected wait for a start is too long (``admission_max_queue_wait``):
a request that queues behind ``ahead`` others starts after ``ahead + 1`` starts out of the queue.

Measured: starts out of the queue over the seconds the queue held requests, so it expects to wait
``(ahead + 1) / rate``. While requests wait, starts are paced by the server alone (a stream ending, a start
finishing, the capacity estimate freeing a slot), whichever limit binds; while it is empty they follow the arrivals
and say nothing about the server, so that time is not counted. Smoothed per start, not per second (each start weighs
``1 - 1/MEMORY_STARTS`` of the one after it), so that a slow queue (one start in tens of seconds) is judged on as
many starts as a fast one; the seconds since the last start count too, so a queue that stopped moving reads as slow
before its next start. It is trusted after ``MIN_STARTS`` starts out of the queue.

Until then, a prior from what every instance sees even while its queue stays empty (a warm server whose burst
begins now: the H200 burst of issue 48 queued ~40 requests per instance within its first second, long before two
had started out of the queue): the mean lifetime of its streams (admitted -> ended) and the mean length of their
starts (admitted -> first audio, or -> the end of a stream that sent none: either frees its start slot), each over
the last ~``MEMORY_STREAMS`` streams. The request's start is the ``ahead + 1``-th from now and needs two things:
- a stream slot: ``running + ahead + 1 - stream_limit`` streams must end first (``stream_limit``: what
  ``max_running`` and the capacity estimate allow now); streams end at ``running / lifetime`` per second;
- a start slot (``max_starting``, the stagger): ``starting + ahead + 1 - max_starting`` starts must finish first,
  at ``max_starting / start length`` per second.
Its wait is the longer of the two: the limit that binds for its position. A burst's first places, those the free
stream slots hold, are paced by the stagger (a start is over in about a second); the places past them by streams
ending (a stream lasts tens of seconds), so a warm server refuses a burst's surplus from its first request. Rough:
streams that started together end together, not at an even pace, and the ends of streams started meanwhile are not
counted (the queue reads slower than it drains past one lifetime); the measured rate replaces it once it is
trusted. A needed mean not learned yet (a cold server: no stream ended, or none played) leaves that wait unknown
(None): the bound is then off.

Pure logic: times come in as arguments; the caller serializes calls (``Admission``'s lock).
"""

from __future__ import annotations

from dataclasses import dataclass

# starts remembered: at the ~2 starts/s of an H200 instance under a burst, the last ~4 s (adapts within a burst as
# the pace moves from staggered starts to streams ending, yet one uneven gap moves it by 1/8 only)
MEMORY_STARTS = 8
# starts out of the queue before the rate is trusted: one gap alone may be a stream that happened to end just
# after the queue formed (or long after)
MIN_STARTS = 2
# streams the prior's lifetimes and start lengths are averaged over: the recent load (a stream's length depends on
# how many share the GPU), yet not one odd stream (cancelled at once, or the longest answer)
MEMORY_STREAMS = 16


@dataclass(frozen=True)
class Occupancy:
    """Where a request queues besides the requests ahead of it: the streams running and starting, and their limits
    now (the prior's input)."""
    running: int
    starting: int        # admitted, not playing yet
    stream_limit: int    # streams that may run now: max_running, or fewer by the capacity estimate
    max_starting: int    # streams that may be starting at once (0: no limit)


class RecentMean:
    """The mean of the last ~``memory`` values: their plain mean until there are that many, then each new one weighs
    ``1/memory`` (an exponential average), so the first value counts at once and old ones fade."""

    def __init__(self, memory: int):
        self.memory = memory
        self.count = 0
        self.value: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        self.value = value if self.value is None else self.value + (value - self.value) / min(self.count, self.memory)


class QueueDrain:
    def __init__(self, memory_starts: int = MEMORY_STARTS, min_starts: int = MIN_STARTS,
                 memory_streams: int = MEMORY_STREAMS):
        if min(memory_starts, min_starts, memory_streams) < 1:
            raise ValueError(f"memory_starts, min_starts and memory_streams must be >= 1, got {memory_starts}, "
                             f"{min_starts}, {memory_streams}")
        self.min_starts = min_starts
        self._keep = 1 - 1 / memory_starts  # the weight of a start (and its gap) per start after it
        self._starts = 0.0       # starts out of the queue, weighted
        self._seconds = 0.0      # the seconds the queue held requests before each of them, weighted alike
        self._open_s = 0.0       # seconds the queue held requests since its last start
        self._seen = 0           # starts out of the queue, in all
        self._mark: float | None = None  # counted up to here, and the queue held requests since (None: empty)
        self.lifetime_s = RecentMean(memory_streams)  # admitted -> ended
        self.start_s = RecentMean(memory_streams)     # admitted -> first audio (or -> ended, without any)

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

    def stream_played(self, start_s: float) -> None:
        """A stream sent its first audio ``start_s`` seconds after it was admitted (started, not arrived)."""
        self.start_s.add(start_s)

    def stream_ended(self, lifetime_s: float, played: bool) -> None:
        """A stream ended ``lifetime_s`` seconds after it was admitted; one that never ``played`` ended its start
        with it."""
        self.lifetime_s.add(lifetime_s)
        if not played:
            self.start_s.add(lifetime_s)

    def per_second(self) -> float | None:
        """Starts out of the queue per second while it holds requests (None: not learned yet)."""
        seconds = self._seconds + self._open_s
        if self._seen < self.min_starts or seconds <= 0:  # starts with no time between them tell no pace either
            return None
        return self._starts / seconds

    def wait_s(self, ahead: int, occupancy: Occupancy) -> float | None:
        """Expected seconds until a request queued behind ``ahead`` others starts: by the measured rate once it is
        learned, else by the prior (None: neither known)."""
        rate = self.per_second()
        return (ahead + 1) / rate if rate is not None else self.prior_wait_s(ahead, occupancy)

    def prior_wait_s(self, ahead: int, occupancy: Occupancy) -> float | None:
        """The wait from stream lifetimes and start lengths: the longer of the waits for a stream slot and for a
        start slot (None: a mean it needs is not learned yet)."""
        ends = occupancy.running + ahead + 1 - occupancy.stream_limit
        plays = occupancy.starting + ahead + 1 - occupancy.max_starting if occupancy.max_starting else 0
        waits = [0.0]
        if ends > 0:
            if self.lifetime_s.value is None:
                return None
            waits.append(ends * self.lifetime_s.value / max(1, occupancy.running))
        if plays > 0:
            if self.start_s.value is None:
                return None
            waits.append(plays * self.start_s.value / occupancy.max_starting)
        return max(waits)
