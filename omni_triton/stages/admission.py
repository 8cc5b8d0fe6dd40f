"""Admission by real-time capacity: start a stream only when the server can keep every playing stream fed.

A listener needs 1 audio-second per second. ``RealtimeCapacity`` estimates what the server generates at a
number of concurrent streams: the talker's time per frame step grows about linearly with its batch (the
measured steps: docs/performance.md), so it keeps ``step_s(b) = a + c * b`` fitted online to
what the orchestrator sees (frames received per second over the streams producing them), starting from a
prior. Audio-seconds per second at ``b`` streams = ``b / step_s(b) * FRAME_S``. A new stream is admitted when
``b + 1`` streams would each still get ``headroom`` x real time; a forced capacity (a launch option) replaces
the estimate with a fixed number of audio-seconds per second (tests; a deployment that measured its own).

Starts are staggered too (``max_starting``): a stream's start (thinker and talker prefills, its first frames and
vocoder call) is the costliest part of its life, and a burst of starts stalls every playing stream's frames at
once (most of 64 streams started together ran dry right after their first chunk: docs/performance.md), so at
most ``max_starting`` streams may be admitted and not yet playing; the rest wait in the queue.
``Admission`` holds the running count and a FIFO of waiting requests: a request starts at once when nothing
waits and the limits allow it, else waits in the queue (started in arrival order as streams end or capacity
frees up), else -- past ``queue_limit`` waiting -- is refused. By default (``queue_limit`` None) the queue holds
no more than the free slots: requests waiting and running together stay within ``max_held`` (``max_running``
unless the pipeline is split among instances: see ``Admission``; as TGI's
``max_concurrent_requests``), so a request that queues waits for at most ``max_running`` starts, and a burst past
that is refused at once instead of waiting for seconds behind it; a closed loop of up to ``max_running`` clients
never sees a refusal. ``max_wait_s`` bounds the wait in time too (as the queue timeout of Triton's dynamic batcher
with ``timeout_action: REJECT``): a request that waited that long is refused instead of starting late
(``expired``). ``max_queue_wait_s`` bounds the expected wait instead, when a request arrives: one that would queue
is refused at once if it expects to wait longer for its start (an H200 burst: the default queue let ~40 requests
wait behind ~25 streams per instance, and requests arriving after the burst waited 7 s for theirs). ``QueueDrain``
expects: by the queue's drain rate, learned from the starts out of it, and before that by a prior from the
lifetimes and start lengths of recent streams (a warm server refuses a burst's surplus from its first request);
nothing is refused so before either is learned (a cold server).
It counts what waited, for how long, and what was refused (the orchestrator's gauges). It admits onto one pipeline:
with ``serve --pipelines`` each pipeline's orchestrator instance has its own, so every limit holds per pipeline and
each learns its own GPUs' capacity.

A pipeline served by several orchestrator instances (``--instances orchestrator=K``) gives each 1/K of its limits
(``split_limit``), and each instance's capacity sees 1/K of the pipeline's streams: Triton hands requests to the
instances in turn, so each instance's streams stand for ``share`` x as many on the pipeline's GPUs, and its
estimate is kept, and asked, in the pipeline's streams. Pure logic: times come in as arguments.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from omni_triton.stages.queue_drain import Occupancy, QueueDrain

FRAME_S = 1 / 12.5           # audio per codec frame
HEADROOM = 1.1               # each stream should get at least this x real time
# (a, c): the served talker's frame step at full size, as first measured (docs/performance.md): a prior only
PRIOR_STEP_S = (0.0075, 6e-5)


class RealtimeCapacity:
    def __init__(self, forced_audio_s_per_s: float | None = None, prior: tuple[float, float] = PRIOR_STEP_S,
                 smoothing: float = 0.3, headroom: float = HEADROOM, share: int = 1):
        """``forced_audio_s_per_s``: a fixed capacity instead of the learned one. ``prior``: (a, c) of
        ``step_s`` before observations; ``smoothing``: weight of a new observation in its batch size's running
        mean; ``share``: the pipeline's orchestrator instances (each holds 1/share of its streams)."""
        if forced_audio_s_per_s is not None and not forced_audio_s_per_s > 0:
            raise ValueError(f"admission capacity must be > 0 audio-seconds per second, got {forced_audio_s_per_s}")
        if share < 1:
            raise ValueError(f"share must be >= 1 orchestrator instance, got {share}")
        self.forced = forced_audio_s_per_s
        self.prior, self.smoothing, self.headroom, self.share = prior, smoothing, headroom, share
        self._step_s: dict[int, float] = {}  # the pipeline's streams -> running mean of seconds per frame step

    def observe(self, streams: int, frames: int, seconds: float, batch: int | None = None) -> None:
        """``frames`` received in ``seconds`` over ``streams`` streams that were producing them throughout, while
        ``batch`` streams of this instance (default ``streams``) shared the server."""
        batch = streams if batch is None else batch
        if streams < 1 or frames < 1 or seconds <= 0 or batch < streams:
            return
        step = streams * seconds / frames  # each stream got frames / streams of them
        batch *= self.share  # the pipeline's streams, the other instances' included
        old = self._step_s.get(batch)
        self._step_s[batch] = step if old is None else old + self.smoothing * (step - old)

    def step_s(self, streams: int) -> float:
        """Seconds per frame step at ``streams`` streams: the prior until a batch size is observed, the prior's
        slope through the one observed, then a least-squares line through the observed (slope >= 0: more
        streams are never cheaper)."""
        a0, c0 = self.prior
        if not self._step_s:
            return a0 + c0 * streams
        if len(self._step_s) == 1:
            ((b, s),) = self._step_s.items()
            return max(1e-6, s + c0 * (streams - b))
        points = list(self._step_s.items())
        mean_b = sum(b for b, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_b) * (s - mean_s) for b, s in points) / spread)
        return max(1e-6, mean_s + slope * (streams - mean_b))

    def audio_s_per_s(self, streams: int) -> float:
        """What the server generates with ``streams`` streams running (all of them together)."""
        if self.forced is not None:
            return self.forced
        return streams / self.step_s(streams) * FRAME_S if streams else 0.0

    def admits(self, running: int) -> bool:
        """Whether ``running + 1`` streams of this instance (``share`` x as many on the pipeline) would each still
        get ``headroom`` x real time."""
        streams = (running + 1) * self.share
        return self.audio_s_per_s(streams) >= streams * self.headroom

    def instance_audio_s_per_s(self, running: int) -> float:
        """This instance's part of what the pipeline generates while this instance runs ``running`` streams."""
        return self.audio_s_per_s(running * self.share) / self.share


def split_limit(limit: int | None, share: int) -> int | None:
    """One of ``share`` orchestrator instances' part of a pipeline's admission limit (0 and None stay as they are);
    at least 1 where the limit is not 0, so the parts may add up to a little more than the whole."""
    return limit if not limit else max(1, -(-limit // share))


@dataclass
class Waiting:
    item: Any
    since: float


class Admission:
    """Thread-safe: the orchestrator's request threads and its dispatcher call it."""

    def __init__(self, max_running: int, queue_limit: int | None, capacity: RealtimeCapacity | None,
                 max_starting: int = 0, max_wait_s: float = 0.0, max_held: int | None = None,
                 max_queue_wait_s: float = 0.0):
        """``max_running`` streams, ``max_starting`` admitted and not yet playing at once (0: no limit), a
        ``capacity`` learned from their frames (None: by ``max_running`` alone); ``queue_limit`` requests
        waiting (None: the free slots, ``max_held`` less those running), none longer than ``max_wait_s``
        (0: no limit). ``max_held``: requests running and waiting together with the default queue (None:
        ``max_running``); one of K orchestrator instances of a pipeline runs 1/K of its streams but may hold up to
        all of them, since Triton hands requests to the instances in turn, not by their load. ``max_queue_wait_s``:
        a request that would wait longer than this for its start, as ``QueueDrain`` expects it, is refused when it
        arrives (0: no limit)."""
        if min(max_starting, max_wait_s, max_queue_wait_s, queue_limit or 0) < 0 or max_running < 1:
            raise ValueError(f"max_running must be >= 1, queue_limit, max_starting, max_wait_s and max_queue_wait_s "
                             f">= 0, got {max_running}, {queue_limit}, {max_starting}, {max_wait_s}, "
                             f"{max_queue_wait_s}")
        self.max_running, self.queue_limit, self.max_starting = max_running, queue_limit, max_starting
        self.max_wait_s, self.max_queue_wait_s = max_wait_s, max_queue_wait_s
        self.max_held = max_running if max_held is None else max_held
        if self.max_held < max_running:
            raise ValueError(f"max_held must be >= max_running {max_running}, got {max_held}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._queue: deque[Waiting] = deque()
        self._drain = QueueDrain()  # learned whether or not max_queue_wait_s is set: a gauge shows it
        self.running = 0
        self.starting = 0        # admitted, not playing yet
        self.waited = 0          # requests that started after waiting in the queue
        self.wait_s = 0.0        # their waits, summed
        self.refused = 0

    def _can_start(self, running: int | None = None, starting: int | None = None) -> bool:
        running = self.running if running is None else running
        starting = self.starting if starting is None else starting
        if running >= self.max_running or (self.max_starting and starting >= self.max_starting):
            return False
        return running == 0 or self.capacity is None or self.capacity.admits(running)

    def _count_start(self) -> None:
        self.running += 1
        self.starting += 1

    def arrive(self, item: Any, now: float) -> str:
        """'start' (counted as running now), 'queued' or 'refused'."""
        with self._lock:
            self._drain.update(now, waiting=bool(self._queue))  # the rate as of now: the wait so far counts
            decision = self._decision()
            if decision == "start":
                self._count_start()
            elif decision == "queued":
                self._queue.append(Waiting(item, now))
                self._drain.update(now, waiting=True)
            else:
                self.refused += 1
            return decision

    def _decision(self, running: int | None = None, starting: int | None = None, queued: int | None = None) -> str:
        """Under the lock: what ``arrive`` answers a request that comes now (or in the state given)."""
        running = self.running if running is None else running
        starting = self.starting if starting is None else starting
        queued = len(self._queue) if queued is None else queued
        if not queued and self._can_start(running, starting):
            return "start"
        return "queued" if queued < self._queue_room(running, starting) else "refused"

    def _queue_room(self, running: int, starting: int) -> int:
        """Requests that may wait: by ``queue_limit``, and of those the ones within ``max_queue_wait_s``."""
        return self._wait_room(running, starting, self._limit_room(running))

    def _limit_room(self, running: int) -> int:
        """Requests that may wait by ``queue_limit`` (by default the free slots)."""
        if self.queue_limit is None:
            return self.max_held - running
        return self.queue_limit

    def _wait_room(self, running: int, starting: int, places: int) -> int:
        """Of the first ``places`` in the queue, those whose request expects its start within ``max_queue_wait_s``
        (all of them where the bound is off or the wait is not known yet)."""
        if not self.max_queue_wait_s:
            return places
        occupancy = self._occupancy(running, starting)
        for ahead in range(places):  # the waits grow with the place: the first one past the bound ends the room
            wait = self._drain.wait_s(ahead, occupancy)
            if wait is not None and wait > self.max_queue_wait_s + 1e-9:
                return ahead
        return places

    def _occupancy(self, running: int, starting: int) -> Occupancy:
        return Occupancy(running, starting, self._stream_limit(running), self.max_starting)

    def _stream_limit(self, running: int) -> int:
        """Streams that may run now, by ``max_running`` and the capacity estimate (``_can_start`` less the stagger):
        searched from ``running``, where it usually is under load (the capacity admits fewer as streams grow)."""
        if self.capacity is None:
            return self.max_running
        limit = min(max(running, 1), self.max_running)  # one always starts when none runs
        while limit > 1 and not self.capacity.admits(limit - 1):
            limit -= 1
        while limit < self.max_running and self.capacity.admits(limit):
            limit += 1
        return limit

    def refusal(self) -> str:
        """Why ``arrive`` refused, naming the limit."""
        with self._lock:
            return self._refusal()

    def outlook(self) -> tuple[int, str]:
        """(room, refusal): how many requests arriving now, one after the other, would start or wait before
        ``arrive`` refuses one, and the refusal it would answer then (naming the limit). Nothing ends meanwhile:
        what a request on its way here is counted against (``admission_board``)."""
        with self._lock:
            running, starting, queued, room = self.running, self.starting, len(self._queue), 0
            while not queued and self._can_start(running, starting):  # as ``_decision``: those that would start
                running, starting, room = running + 1, starting + 1, room + 1
            waiting_room = max(0, self._queue_room(running, starting) - queued)  # then those that would wait
            return room + waiting_room, self._refusal(running, starting, queued + waiting_room)

    def _refusal(self, running: int | None = None, starting: int | None = None, queued: int | None = None) -> str:
        """Under the lock: why a request is refused now (or in the state given)."""
        running = self.running if running is None else running
        starting = self.starting if starting is None else starting
        queued = len(self._queue) if queued is None else queued
        limit_room = self._limit_room(running)
        wait_room = self._wait_room(running, starting, limit_room)
        if wait_room < limit_room:  # the expected wait is the bound
            occupancy = self._occupancy(running, starting)
            wait = self._drain.wait_s(queued, occupancy)
            if wait is None:  # a mean its place needs is not learned yet: it waits at least as the first place refused
                wait = self._drain.wait_s(wait_room, occupancy)
            return (f"server busy: an estimated {wait:.1f} s wait for admission behind {running} streaming and "
                    f"{queued} waiting (admission_max_queue_wait {self.max_queue_wait_s:g} s); retry later")
        if self.queue_limit is None:  # waiting and running: every slot taken
            return (f"server busy: {running} streaming and {queued} waiting for admission, "
                    f"{self.max_held} in all (max_inflight_requests; admission_queue: the free slots); "
                    "retry later")
        if self.queue_limit:
            return (f"server busy: {self.queue_limit} requests already waiting for admission (admission_queue) "
                    f"behind {running} streaming; retry later")
        if running >= self.max_running:
            return f"server busy: {self.max_running} requests in flight (max_inflight_requests); retry later"
        if self.capacity is None or (self.max_starting and starting >= self.max_starting):
            return (f"server busy: {starting} streams starting (admission_max_starting "
                    f"{self.max_starting}; admission_queue 0); retry later")
        return (f"server busy: another stream would make the {running} playing run dry (capacity "
                f"{self.capacity.instance_audio_s_per_s(running + 1):.2f} audio-s/s; admission_queue 0); "
                "retry later")

    def playing(self, start_s: float) -> None:
        """A started stream sent its first audio, ``start_s`` seconds after it was admitted (``arrive`` or ``due``
        counted it as running): its start is over."""
        with self._lock:
            self.starting -= 1
            self._drain.stream_played(start_s)

    def finished(self, lifetime_s: float, played: bool = True) -> None:
        """A started stream ended, ``lifetime_s`` seconds after it was admitted; ``played``: ``playing`` was called
        for it."""
        with self._lock:
            self.running -= 1
            if not played:
                self.starting -= 1
            self._drain.stream_ended(lifetime_s, played)

    def due(self, now: float) -> list[tuple[Any, float]]:
        """Waiting requests that may start now, in arrival order, with their waits (each counted as running)."""
        started = []
        with self._lock:
            while self._queue and self._can_start():
                waiting = self._queue.popleft()
                self._count_start()
                self.waited += 1
                self.wait_s += now - waiting.since
                started.append((waiting.item, now - waiting.since))
            self._drain.update(now, waiting=bool(self._queue), started=len(started))
        return started

    def expired(self, now: float) -> list[tuple[Any, float]]:
        """Waiting requests that waited ``max_wait_s`` or longer, with their waits: out of the queue, counted as
        refused (the queue is in arrival order, so they are at its head)."""
        gone = []
        with self._lock:
            while self.max_wait_s and self._queue and now - self._queue[0].since >= self.max_wait_s:
                waiting = self._queue.popleft()
                self.refused += 1
                gone.append((waiting.item, now - waiting.since))
            self._drain.update(now, waiting=bool(self._queue))
        return gone

    def expiry(self, waited_s: float) -> str:
        """Why ``expired`` took a request that waited ``waited_s``, naming the limit."""
        with self._lock:
            return (f"server busy: waited {waited_s:.1f} s for admission behind {self.running} streaming "
                    f"(admission_max_wait {self.max_wait_s:g} s); retry later")

    def drop(self, predicate) -> list[Any]:
        """Remove the waiting requests for which ``predicate(item)`` is true (cancelled, past their deadline)."""
        with self._lock:
            kept, gone = deque(), []
            for waiting in self._queue:
                (gone.append(waiting.item) if predicate(waiting.item) else kept.append(waiting))
            self._queue = kept
            if not kept:
                self._drain.emptied()
        return gone

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def expected_wait_s(self) -> float:
        """Expected seconds a request that queued now would wait for its start (0: it would start at once, or
        nothing is learned yet)."""
        with self._lock:
            return self._drain.wait_s(len(self._queue), self._occupancy(self.running, self.starting)) or 0.0
