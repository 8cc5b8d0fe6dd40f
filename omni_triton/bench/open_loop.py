"""Open-loop load (DESIGN.md section 6): random arrivals at a fixed rate for a fixed duration (by default exactly
rate x duration of them, at uniform times: a Poisson process given its count), each request sent at its arrival
time on a stream of its own, however many are still in flight.

A closed loop (bench/driver.py) sends a client's next request only when its last one ended, so an overloaded
server slows its own load down and its TTFA turns into admission wait. Here the load does not wait for the
server: what a rate costs shows up as TTFA, dry streams and a backlog.

Streams: no two requests in flight share one; a stream whose request ended is reused by a later arrival (a pool
of open streams, as an HTTP client keeps a pool of connections), a new one opened when none is idle.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np

from omni_triton.bench.metrics import LevelSummary, RequestTiming, percentile, summarize
from omni_triton.bench.runners import Runner, Worker

# A request sent this much after its arrival time is a late start: the client fell behind its schedule (too many
# streams for its host), so the rate it offered is lower than the one asked for.
LATE_START_S = 0.050
DRAIN_TIMEOUT_CODE = "DRAIN_TIMEOUT"  # a request still running --drain-timeout after the last arrival: cancelled


# How arrival_times counts its arrivals (`bench --arrivals`), and what each is, for the reports.
EXACT, POISSON = "exact", "poisson"
ARRIVAL_COUNTS = (EXACT, POISSON)
ARRIVALS_LINE = {
    EXACT: "N = rate x duration (rounded half up, at least 1), uniform times (a Poisson process given its count): "
           "every rate offers the rate it names",
    POISSON: "Poisson with a free count (seeded exponential gaps of mean 1/rate, `--arrivals poisson`, the only kind "
             "before that option): a sample offers more or less than the rate it names (achieved /s)",
}


def arrivals_of(settings: dict) -> str:
    """How a report's arrivals were counted (its open-loop or soak settings' "arrivals"): a report from before
    `bench --arrivals` has none recorded, and had the free count."""
    return settings.get("arrivals", POISSON)


def arrivals_line(settings: dict) -> str:
    """The reports' line saying how the arrivals of ``settings`` were drawn."""
    return f"Arrivals: {ARRIVALS_LINE[arrivals_of(settings)]}."


def arrival_times(rate: float, duration_s: float, seed: int, count: str = EXACT) -> np.ndarray:
    """Seconds since the start of each arrival in [0, duration_s), sorted, drawn from a generator seeded with
    ``seed``. ``count``:

    - ``"exact"``: N = rate * duration_s arrivals (rounded half up, at least 1), their times i.i.d. uniform on
      [0, duration_s). Given its count in a window, a Poisson process's times are i.i.d. uniform: this is a Poisson
      process conditioned on N, as bursty, offering exactly ``rate``. The same uniforms at every rate, more of
      them at a higher one: a rate's arrivals are a lower rate's and some more.
    - ``"poisson"``: the free count (before ``bench --arrivals``, the only one): exponential gaps of mean 1 / rate,
      the same unit exponentials at every rate scaled by 1 / rate (a higher rate is the same schedule played
      faster). Its count varies about rate * duration_s (seed 0, 20 s at 16/s: 280 arrivals, 14/s offered)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration_s must be > 0, got {rate} and {duration_s}")
    if count not in ARRIVAL_COUNTS:
        raise ValueError(f"count must be one of {', '.join(ARRIVAL_COUNTS)}, got {count!r}")
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    if count == EXACT:
        return np.sort(rng.random(max(1, math.floor(expected + 0.5))) * duration_s)
    gaps = rng.standard_exponential(int(expected + 6 * math.sqrt(expected) + 16))
    while gaps.sum() / rate < duration_s:  # a schedule longer than the draw: more gaps from the same stream
        gaps = np.concatenate([gaps, rng.standard_exponential(gaps.size)])
    times = np.cumsum(gaps) / rate
    return times[times < duration_s]


@dataclass
class RateRun:
    """What one rate's run saw, before any statistics."""

    timings: list[RequestTiming]   # one per request sent
    start_lags_s: list[float]      # per request sent: its send time minus its arrival time
    not_started: int               # arrivals dropped: max_in_flight requests were running
    drained_out: int               # requests cancelled at the drain timeout (their timing says DRAIN_TIMEOUT)
    peak_in_flight: int
    wall_s: float                  # the schedule's start -> the last request ended (0: none sent)


class StreamPool:
    """Open streams (a runner's workers) for the open loop: an idle one for each new request, a new one when
    none is idle. Kept across rates, so a sweep opens as many streams as its busiest moment needs."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._opened: list[Worker] = []
        self._lock = threading.Lock()

    def take(self) -> Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            worker = self.runner.open_worker()
            with self._lock:
                self._opened.append(worker)
            return worker

    def give_back(self, worker: Worker) -> None:
        self._idle.put(worker)

    def close(self) -> None:
        with self._lock:
            for worker in self._opened:
                worker.close()
            self._opened.clear()


def run_rate(pool: StreamPool, tensors: dict[str, np.ndarray] | Callable[[int], Any], arrivals: np.ndarray, *,
             max_in_flight: int, drain_timeout_s: float, on_done: Callable[[RequestTiming], None] | None = None,
             clock: Callable[[], float] = time.perf_counter) -> RateRun:
    """Send one request at each of ``arrivals`` (seconds from now), each on its own thread and stream, then wait
    for all of them; one still running ``drain_timeout_s`` after the last arrival is cancelled (its worker must
    have ``cancel()``). An arrival finding ``max_in_flight`` requests running is not sent (``not_started``).
    ``tensors``: every request's, or a function of the arrival's index giving what its worker sends (a mix)."""
    if max_in_flight < 1 or drain_timeout_s <= 0:
        raise ValueError(f"max_in_flight must be >= 1 and drain_timeout_s > 0, got {max_in_flight}, "
                         f"{drain_timeout_s}")
    timings: list[RequestTiming] = []
    lags: list[float] = []
    ended_at: list[float] = []
    running: dict[int, Worker] = {}  # arrival index -> its worker, while its request runs
    drained: set[int] = set()
    lock = threading.Lock()
    closed = threading.Event()
    in_flight = threading.Semaphore(max_in_flight)
    peak = [0]

    def send(index: int, due: float) -> None:
        try:
            worker = pool.take()  # opening a stream, when none is idle, counts in the start lag
        except Exception as error:  # e.g. the server is gone: this request fails, the others go on
            with lock:
                timings.append(RequestTiming(error=f"{type(error).__name__}: {error}",
                                             error_code=type(error).__name__))
                lags.append(clock() - due)
                ended_at.append(clock())
            in_flight.release()
            return
        with lock:
            running[index] = worker
            peak[0] = max(peak[0], len(running))
        sent = clock()
        timing = worker.request(tensors(index) if callable(tensors) else tensors)
        ended = clock()
        with lock:
            if closed.is_set():  # given up on below: its row is already there
                return
            del running[index]
            if index in drained:
                timing.error_code = DRAIN_TIMEOUT_CODE
                timing.error = f"{DRAIN_TIMEOUT_CODE}: still running {drain_timeout_s:g} s after the last arrival"
            timings.append(timing)
            lags.append(sent - due)
            ended_at.append(ended)
        if index not in drained:  # a cancelled stream is still closing: never reused
            pool.give_back(worker)
        in_flight.release()
        if on_done is not None:
            on_done(timing)

    threads = []
    not_started = 0
    start = clock()
    for index, offset in enumerate(arrivals):
        due = start + float(offset)
        pause = due - clock()
        if pause > 0:
            time.sleep(pause)
        if not in_flight.acquire(blocking=False):
            not_started += 1
            continue
        thread = threading.Thread(target=send, args=(index, due), name=f"open-loop-{index}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = clock() + drain_timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - clock()))
    with lock:
        still_running = dict(running)
        drained.update(still_running)
    for worker in still_running.values():
        worker.cancel()
    for thread in threads:
        thread.join(30.0)  # the cancelled requests return with CANCELLED
    with lock:
        closed.set()
        for index in running:  # not even the cancel ended it: left behind, a row of its own
            timings.append(RequestTiming(error=f"{DRAIN_TIMEOUT_CODE}: did not end when cancelled",
                                         error_code=DRAIN_TIMEOUT_CODE))
        wall_s = max(ended_at) - start if ended_at else 0.0
        return RateRun(timings=list(timings), start_lags_s=list(lags), not_started=not_started,
                       drained_out=len(still_running), peak_in_flight=peak[0], wall_s=wall_s)


@dataclass
class RateSummary:
    """One system at one offered rate: the open loop's row. The request metrics are the closed loop's
    (``metrics``, bench.metrics.summarize over the rate's requests; its ``concurrency`` is the most requests in
    flight at once and its throughput counts completed requests from the schedule's start to the last request's
    end, the drain included, as ``vllm bench serve`` does: past capacity it is what the server completes)."""

    rate: float                    # named: requests/s the schedule was drawn at (offered exactly by EXACT arrivals)
    duration_s: float              # arrivals were drawn over this window
    arrivals: int                  # arrivals in the window (sent + not_started)
    sent: int
    completed: int
    failed_by_code: dict[str, int]  # Triton error code (or DRAIN_TIMEOUT) -> requests
    not_started: int               # arrivals dropped at the client's in-flight cap
    late_starts: int               # sent more than LATE_START_S after their arrival time
    start_lag_p99_s: float | None
    achieved_rate: float           # requests sent / duration_s: the rate this sample of arrivals offered
    metrics: LevelSummary
    verdict: str | None = None     # None: meets the goodput criterion; else why not (bench.goodput)
    ended_as_meant: int = 0        # a request mix's: failed as they were meant to (cancelled, expired), not counted

    def to_dict(self) -> dict:
        """One flat row: the request metrics with the open-loop fields beside them."""
        row = {key: value for key, value in asdict(self).items() if key != "metrics"}
        return {**row, **self.metrics.to_dict(), "passes": self.verdict is None}


def summarize_rate(system: str, rate: float, duration_s: float, run: RateRun,
                   ended_as_meant: Callable[[RequestTiming], bool] | None = None) -> RateSummary:
    """The row of one rate's run. ``ended_as_meant``: with a request mix (bench.soak_requests), whether a request
    ended as it was meant to; the failed ones it says so of (a client's cancel, an expired ``deadline_s``) are
    neither failures nor in the request metrics, only counted (``ended_as_meant``)."""
    meant: list[RequestTiming] = []
    counted: list[RequestTiming] = []
    for timing in run.timings:
        (meant if not timing.ok and ended_as_meant is not None and ended_as_meant(timing) else counted).append(timing)
    failed = Counter(t.error_code or "UNKNOWN" for t in counted if not t.ok)
    metrics = summarize(system, run.peak_in_flight, counted, run.wall_s or 1.0)
    if not run.wall_s:  # nothing was sent: no throughput, no wall time
        metrics = replace(metrics, wall_s=0.0)
    return RateSummary(
        rate=rate, duration_s=duration_s, arrivals=len(run.timings) + run.not_started, sent=len(run.timings),
        completed=sum(t.ok for t in run.timings), failed_by_code=dict(sorted(failed.items())),
        not_started=run.not_started, late_starts=sum(lag > LATE_START_S for lag in run.start_lags_s),
        start_lag_p99_s=percentile(run.start_lags_s, 99), achieved_rate=len(run.timings) / duration_s,
        metrics=metrics, ended_as_meant=len(meant))
