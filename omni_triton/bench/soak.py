"""Issue 48's three scenarios against a served pipeline, on the open loop (bench.open_loop) with the soak's request
mix (bench.soak_requests), each returning its part of the report: what happened and its checks.

- soak: open-loop arrivals at a rate for a duration (by default exactly rate x duration of them: LoadSettings.arrivals);
  errors by code and by what each request was meant to end with, streams that ran dry, TTFA p50/p95 per window
  (drift), each process's memory and threads sampled every few seconds, and what the idle server holds at the end
  against the start (bench.soak_probes.leaks).
- burst: a base rate, then ``factor`` times it for a few seconds, then the base rate again: every admitted stream
  completes, every other is refused with UNAVAILABLE naming the limit, and how long TTFA takes to be normal again.
- kill: at a rate, one stage's stub process killed: how the requests in flight end, what new requests get until the
  stage is back, and when it is back and serving (a prober sends a small request every ``PROBE_EVERY_S``).

A check is an invariant (the run is wrong when it fails: the exit status says so) or a target (a number to meet,
reported; a CPU run is not expected to meet the GPU's).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from omni_triton.bench.metrics import RAN_DRY_S, dry_time, percentile, ttfa
from omni_triton.bench.open_loop import DRAIN_TIMEOUT_CODE, EXACT, StreamPool, arrival_times, run_rate
from omni_triton.bench.soak_probes import Sampler, ServerProbe, held, leaks, read_gauges
from omni_triton.bench.soak_requests import RequestMix, SoakRunner, SoakTiming, ended_as_meant, fate_of
from omni_triton.client import OmniStreamClient

LIMIT_WORDS = ("max_inflight_requests", "admission_queue", "admission")  # a refusal names one of them
# a refused probe is answered at once: the next one this long after it, so "back" is over-measured by at most this
PROBE_EVERY_S = 0.05
BUSY_WAIT_S = 30.0  # after --kill-after, a kill waits at most this long for the stage to hold a request
OTHER_ERRORS_KEPT = 10  # a kill scenario keeps this many non-UNAVAILABLE failures' messages, the earliest sent
PROBE_REQUEST = dict(max_tokens=2, min_tokens=2, ignore_eos=True, max_audio_frames=4, min_audio_frames=4)


@dataclass(frozen=True)
class LoadSettings:
    """What every scenario's open loop shares."""

    url: str
    mix: RequestMix
    seed: int = 0
    max_in_flight: int = 512
    drain_timeout_s: float = 120.0
    request_timeout_s: float = 120.0  # a request silent this long fails (DEADLINE_EXCEEDED "no response"): a hang
    arrivals: str = EXACT  # bench.open_loop.arrival_times's count: a phase offers exactly its rate, or a free count


def check(name: str, ok: bool, detail: str, kind: str = "invariant") -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail, "kind": kind}


def run_phases(load: LoadSettings, phases: list[tuple[str, float, float]], mix: RequestMix | None = None,
               during: Callable[[float], None] | None = None) -> tuple[list, list[str], float]:
    """Open-loop arrivals over consecutive ``phases`` (name, rate, seconds), one request of the mix each: (the
    timings, each arrival's phase by request index, the run's clock zero). ``during(clock_zero)`` runs on a thread
    of its own beside the load (a kill)."""
    mix = mix or load.mix
    offsets, phase_of, start = [], [], 0.0
    for number, (name, rate, seconds) in enumerate(phases):
        times = arrival_times(rate, seconds, load.seed + number, load.arrivals) + start
        offsets.append(times)
        phase_of += [name] * len(times)
        start += seconds
    arrivals = np.concatenate(offsets)
    requests = mix.draw(len(arrivals))
    clock_zero = time.perf_counter()
    pool = StreamPool(SoakRunner(load.url, clock_zero, load.request_timeout_s))
    helper = threading.Thread(target=during, args=(clock_zero,), daemon=True) if during else None
    try:
        if helper:
            helper.start()
        run = run_rate(pool, lambda index: requests[index], arrivals, max_in_flight=load.max_in_flight,
                       drain_timeout_s=load.drain_timeout_s)
    finally:
        pool.close()
        if helper:
            helper.join()
    # a request that did not even end when cancelled at the drain timeout has a bare row: keep it, as a hang
    timings = [t if isinstance(t, SoakTiming) else SoakTiming(error=t.error, error_code=t.error_code,
                                                               sent_at=float("nan")) for t in run.timings]
    return timings, phase_of, clock_zero


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _ran_dry(timings) -> list:
    return [t for t in timings if t.ok and t.audio_chunks and dry_time(t.audio_chunks) > RAN_DRY_S]


def errors_by_code(timings) -> dict[str, dict[str, int]]:
    """fate -> {error code (or "ok") -> requests}."""
    table: dict[str, Counter] = {}
    for timing in timings:
        table.setdefault(fate_of(timing), Counter())["ok" if timing.ok else (timing.error_code or "UNKNOWN")] += 1
    return {fate: dict(sorted(counts.items())) for fate, counts in sorted(table.items())}


def ttfa_windows(timings, window_s: float) -> list[dict]:
    """TTFA p50/p95 of the requests sent in each ``window_s`` window (every request with audio, whatever its end)."""
    by_window: dict[int, list[float]] = {}
    for timing in timings:
        if (first := ttfa(timing)) is not None:
            by_window.setdefault(int(getattr(timing, "sent_at", 0.0) // window_s), []).append(first)
    return [{"window": k, "start_s": k * window_s, "requests": len(v), "ttfa_p50_ms": _ms(percentile(v, 50)),
             "ttfa_p95_ms": _ms(percentile(v, 95))} for k, v in sorted(by_window.items())]


def memory_growth(samples: list[dict]) -> dict[str, dict]:
    """Per process: RSS (and GPU memory) at the start, median of the second quarter of the samples (after
    warm-up) and of the last quarter, growth between those in %."""
    quarter = max(len(samples) // 4, 1)
    growth = {}
    names = sorted({name for sample in samples for name in sample["processes"]})
    for name in names:
        row = {}
        for metric in ("rss_mib", "gpu_mib"):
            series = [s["processes"][name][metric] for s in samples if name in s["processes"]
                      and s["processes"][name][metric] is not None]
            if not series:
                continue
            warm = float(np.median(series[quarter:2 * quarter] or series))
            late = float(np.median(series[-quarter:]))
            row[metric] = {"start": series[0], "after_warmup": round(warm, 1), "end_window": round(late, 1),
                           "growth_pct": round((late / warm - 1) * 100, 1) if warm else None}
        growth[name] = row
    return growth


def thread_counts(start: dict, samples: list[dict], end: dict, half_s: float) -> dict[str, dict]:
    """Per process of ``start`` (an idle server's snapshot): its threads idle at the start and at ``end``, and the
    most any sample saw in the soak's first half (up to ``half_s``) and in its second. Thread pools grow to what
    the load needs and stay (the orchestrator's request pool, up to its --max-inflight share): at a steady rate
    they are full by the first half's end, so the second half's most stays near the first's and the idle end at
    most the first's (``leaks``' reference); threads left behind by requests grow on past it."""
    counts = {}
    for name, row in start["processes"].items():
        seen = [(s["t"], s["processes"][name]["threads"]) for s in samples if name in s["processes"]
                and s["processes"][name]["threads"] is not None]
        first = [count for t, count in seen if t <= half_s] or [row["threads"] or 0]
        second = [count for t, count in seen if t > half_s]
        counts[name] = {"start": row["threads"], "first_half_most": max(first),
                        "second_half_most": max(second, default=None),
                        "end": end["processes"].get(name, {}).get("threads")}
    return counts


# Memory is flat after warm-up when a process's end window is within this share of its warm-up value, or within
# FLAT_SLACK_MIB, whichever is larger: the share alone would fail a small process on noise (a few MiB of a lazily
# loaded CUDA module, an allocator's next 2 MiB segment) and fail one at 0 MiB (no GPU) on anything.
FLAT_GROWTH = 0.10
FLAT_SLACK_MIB = 64.0


def memory_not_flat(growth: dict[str, dict]) -> list[str]:
    """The processes whose RSS or GPU memory (``memory_growth``'s rows) grew past the flat bound after warm-up, as
    "process metric warm-up -> end MiB"; empty when every one is flat."""
    grown = []
    for name, row in growth.items():
        for metric, label in (("rss_mib", "RSS"), ("gpu_mib", "GPU")):
            if metric not in row:
                continue
            warm, late = row[metric]["after_warmup"], row[metric]["end_window"]
            if late - warm > max(FLAT_GROWTH * warm, FLAT_SLACK_MIB):
                grown.append(f"{name} {label} {warm:g} -> {late:g} MiB")
    return grown


def soak(load: LoadSettings, probe: ServerProbe, rate: float, duration_s: float, window_s: float,
         sample_every_s: float, idle_timeout_s: float) -> dict:
    start_snapshot, _ = probe.wait_idle(idle_timeout_s)
    clock_zero = time.perf_counter()
    with Sampler(probe, sample_every_s, lambda: time.perf_counter() - clock_zero) as sampler:
        timings, _, _ = run_phases(load, [("soak", rate, duration_s)])
    end_snapshot, idle_s = probe.wait_idle(idle_timeout_s)
    threads = thread_counts(start_snapshot, sampler.samples, end_snapshot, duration_s / 2)
    left = leaks(start_snapshot, end_snapshot, {name: row["first_half_most"] for name, row in threads.items()})
    unexpected = [t for t in timings if not ended_as_meant(t)]
    dry = _ran_dry(timings)
    windows = ttfa_windows(timings, window_s)
    full = [w for w in windows if w["start_s"] + window_s <= duration_s] or windows
    drift = (round(full[-1]["ttfa_p95_ms"] / full[0]["ttfa_p95_ms"] - 1, 3)
             if len(full) > 1 and full[0]["ttfa_p95_ms"] else None)
    growth = memory_growth(sampler.samples)
    grown = memory_not_flat(growth)
    return {
        "rate": rate, "duration_s": duration_s, "requests": len(timings),
        "errors_by_fate_and_code": errors_by_code(timings),
        "unexpected_errors": [_describe(t) for t in unexpected[:20]], "unexpected_error_count": len(unexpected),
        "ran_dry": len(dry), "ttfa_windows": windows, "ttfa_p95_drift": drift,
        "memory": growth, "threads": threads, "samples": sampler.samples, "idle_after_s": idle_s,
        "start": start_snapshot, "end": end_snapshot, "leaks": left,
        "checks": [
            check("only the cancelled and expired fail, with CANCELLED / DEADLINE_EXCEEDED", not unexpected,
                  f"{len(unexpected)} unexpected: {[_describe(t) for t in unexpected[:3]]}"),
            check("no request hangs", not any(t.error_code == DRAIN_TIMEOUT_CODE for t in timings),
                  f"{sum(t.error_code == DRAIN_TIMEOUT_CODE for t in timings)} still running at the drain timeout"),
            check("the server is idle after the last request", idle_s is not None,
                  f"idle {idle_s} s after" if idle_s is not None else f"still held: {end_snapshot['gauges']}"),
            check("nothing left behind (gauges, KV blocks, threads, shared memory)", not left, "; ".join(left) or
                  "none"),
            check("no stream ran dry", not dry, f"{len(dry)} of {sum(t.ok for t in timings)} completed", "target"),
            check("TTFA p95 of the last window within 10% of the first", drift is not None and drift <= 0.10,
                  f"drift {drift}", "target"),
            check(f"memory flat after warm-up (RSS and GPU memory per process within {FLAT_GROWTH:.0%} or "
                  f"{FLAT_SLACK_MIB:g} MiB)", not grown, "; ".join(grown) or "all flat", "target"),
        ],
    }


def _describe(timing) -> str:
    return f"#{getattr(timing, 'index', '?')} {fate_of(timing)}: {timing.error}"


def _refusal_names_limit(timing) -> bool:
    return timing.error_code == "UNAVAILABLE" and any(word in (timing.error or "") for word in LIMIT_WORDS)


def burst(load: LoadSettings, probe: ServerProbe, base_rate: float, factor: float, burst_s: float,
          before_s: float, after_s: float, normal_factor: float, idle_timeout_s: float) -> dict:
    """The base rate for ``before_s``, ``factor`` x it for ``burst_s``, the base rate for ``after_s``; requests all
    meant to complete. Normal TTFA: at most ``normal_factor`` x the before phase's p95."""
    start_snapshot, _ = probe.wait_idle(idle_timeout_s)
    mix = replace(load.mix, cancel_fraction=0.0, deadline_fraction=0.0)
    phases = [("before", base_rate, before_s), ("burst", base_rate * factor, burst_s), ("after", base_rate, after_s)]
    timings, phase_of, _ = run_phases(load, phases, mix)
    end_snapshot, idle_s = probe.wait_idle(idle_timeout_s)
    by_phase = {name: [t for t in timings if phase_of[t.index] == name] for name, *_ in phases}
    refused = [t for t in timings if t.error_code == "UNAVAILABLE"]
    admitted = [t for t in timings if t.error_code != "UNAVAILABLE"]
    failed_admitted = [t for t in admitted if not t.ok]
    unnamed = [t for t in refused if not _refusal_names_limit(t)]
    dry = _ran_dry(admitted)
    baseline = percentile([v for t in by_phase["before"] if t.ok and (v := ttfa(t)) is not None], 95)
    burst_end = before_s + burst_s
    recovered = _recovered_after(by_phase["after"], burst_end, None if baseline is None else baseline * normal_factor)
    refusal_s = [t.total_s for t in refused]
    slowest_admitted_ttfa = [v for t in admitted if (v := ttfa(t)) is not None]
    # thread pools grow to what the burst needed and stay: threads are the soak's to compare
    left = [x for x in leaks(start_snapshot, end_snapshot) if "threads" not in x]
    return {
        "base_rate": base_rate, "factor": factor, "burst_s": burst_s, "before_s": before_s, "after_s": after_s,
        "requests": {name: len(rows) for name, rows in by_phase.items()},
        "admitted": len(admitted), "refused": len(refused), "errors_by_fate_and_code": errors_by_code(timings),
        "refusal_messages": sorted({t.error for t in refused})[:5],
        "refusal_ms_max": _ms(max(refusal_s, default=None)), "admitted_ttfa_ms_min": _ms(min(slowest_admitted_ttfa,
                                                                                             default=None)),
        "ran_dry": len(dry), "baseline_ttfa_p95_ms": _ms(baseline), "normal_ttfa_ms": _ms(baseline and
                                                                                        baseline * normal_factor),
        "ttfa_after_burst": [{"sent_after_burst_s": round(t.sent_at - burst_end, 2), "ttfa_ms": _ms(ttfa(t)),
                              "error": t.error_code} for t in sorted(by_phase["after"], key=lambda t: t.sent_at)],
        "recovered_after_s": recovered, "idle_after_s": idle_s, "leaks": left,
        "checks": [
            check("every admitted request completes", not failed_admitted,
                  f"{len(failed_admitted)} failed: {[_describe(t) for t in failed_admitted[:3]]}"),
            check("every refusal is UNAVAILABLE naming the limit", not unnamed,
                  f"{len(unnamed)} of {len(refused)} do not: {[t.error for t in unnamed[:2]]}"),
            check("the server is idle after the burst, nothing left behind", idle_s is not None and not left,
                  "; ".join(left) or f"idle {idle_s} s after"),
            check("no admitted stream ran dry", not dry, f"{len(dry)} of {len(admitted)}", "target"),
            check("refused at once (before any admitted request's first audio)",
                  not refusal_s or not slowest_admitted_ttfa or max(refusal_s) < min(slowest_admitted_ttfa),
                  f"slowest refusal {_ms(max(refusal_s, default=None))} ms", "target"),
            check("TTFA normal again within 10 s of the burst", recovered is not None and recovered <= 10.0,
                  f"recovered {recovered} s after the burst's end", "target"),
        ],
    }


def _recovered_after(after: list, burst_end: float, normal_s: float | None) -> float | None:
    """Seconds from the burst's end to the first request after it from which every request's TTFA is normal (it
    completed within ``normal_s``); None when the last one is not."""
    rows = sorted(after, key=lambda t: t.sent_at)
    recovered = None
    for timing in rows:
        normal = normal_s is not None and timing.ok and (ttfa(timing) or float("inf")) <= normal_s
        if not normal:
            recovered = None
        elif recovered is None:
            recovered = round(max(timing.sent_at - burst_end, 0.0), 2)
    return recovered


def kill_stage(load: LoadSettings, probe: ServerProbe, stage: str, stub_pid: Callable[[], int | None], rate: float,
               duration_s: float, kill_after_s: float, back_timeout_s: float, idle_timeout_s: float) -> dict:
    """Open-loop arrivals at ``rate`` for ``duration_s`` (requests all meant to complete); ``kill_after_s`` in, once
    the stage holds a request (at most BUSY_WAIT_S later), SIGKILL its stub (``stub_pid()`` finds it) and probe
    until a request is served again."""
    mix = replace(load.mix, cancel_fraction=0.0, deadline_fraction=0.0)
    event: dict = {}

    def kill_and_probe(clock_zero: float) -> None:
        time.sleep(kill_after_s)
        # killed while it serves: at a low rate the kill time alone may fall between requests
        waited_until = time.monotonic() + BUSY_WAIT_S
        while not _serving(probe, stage) and time.monotonic() < waited_until:
            time.sleep(0.02)
        pid = stub_pid()
        if pid is None:
            event["error"] = f"no stub process of {stage} found"
            return
        # the time just before the kill: a request that ended before it cannot have been ended by it
        event["killed_perf_counter"], event["killed_unix"] = time.perf_counter(), time.time()
        os.kill(pid, signal.SIGKILL)
        event["killed_at"] = event["killed_perf_counter"] - clock_zero
        event["pid"] = pid
        while time.perf_counter() - clock_zero - event["killed_at"] < back_timeout_s:
            sent = time.perf_counter() - clock_zero
            try:
                with OmniStreamClient(load.url) as client:
                    client.stream("Are you back?", timeout_s=load.request_timeout_s, **PROBE_REQUEST)
                event["back_s"] = round(sent - event["killed_at"], 2)
                event["served_s"] = round(time.perf_counter() - clock_zero - event["killed_at"], 2)
                return
            except Exception as error:  # refused while the stage is down: what it says is part of the report
                event.setdefault("probe_errors", Counter())[f"{getattr(error, 'code', type(error).__name__)}: "
                                                            f"{_short(error)}"] += 1
            time.sleep(PROBE_EVERY_S)

    timings, _, _ = run_phases(load, [(f"kill-{stage}", rate, duration_s)], mix, during=kill_and_probe)
    end_snapshot, idle_s = probe.wait_idle(idle_timeout_s)
    killed_at = event.get("killed_at")
    if killed_at is None:
        return {"stage": stage, "error": event.get("error", "not killed"), "checks": [
            check(f"{stage} stub killed", False, event.get("error", "not killed"))]}
    in_flight = [t for t in timings if t.sent_at < killed_at < t.sent_at + t.total_s]
    after = [t for t in timings if t.sent_at >= killed_at]
    back_at = killed_at + event["back_s"] if "back_s" in event else float("inf")
    while_down = [t for t in after if t.sent_at < back_at]
    in_flight_failed = [t for t in in_flight if not t.ok]
    ends = [round(t.sent_at + t.total_s - killed_at, 2) for t in in_flight_failed]
    not_unavailable = unexpected_around_kill(timings)
    unnamed = [t for t in while_down if not t.ok and f"{stage} stage" not in (t.error or "")]
    probe_errors = dict(event.get("probe_errors", {}))
    hung = [t for t in timings if t.error_code in (DRAIN_TIMEOUT_CODE, "DEADLINE_EXCEEDED")]
    return {
        "stage": stage, "rate": rate, "duration_s": duration_s, "killed_at_s": round(killed_at, 2),
        "killed_perf_counter": event["killed_perf_counter"], "killed_unix": event["killed_unix"],
        "killed_pid": event["pid"], "requests": len(timings), "errors_by_fate_and_code": errors_by_code(timings),
        "in_flight_at_kill": len(in_flight), "in_flight_completed": len(in_flight) - len(in_flight_failed),
        "in_flight_failed_within_s": max(ends, default=None), "in_flight_errors": sorted(
            {_short_text(t.error) for t in in_flight_failed})[:5],
        "sent_while_down": len(while_down), "refused_while_down": sum(not t.ok for t in while_down),
        "probe_errors": probe_errors, "back_s": event.get("back_s"), "served_s": event.get("served_s"),
        "other_errors": other_errors(timings, killed_at), "other_error_count": len(not_unavailable),
        "idle_after_s": idle_s, "held_at_end": held(end_snapshot["gauges"]),
        "checks": [
            check("the stage is back and serving", "back_s" in event,
                  f"served {event.get('served_s')} s after the kill" if "back_s" in event
                  else f"not within {back_timeout_s:g} s"),
            check("no request hangs", not hung, f"{len(hung)} ended by a timeout: {[_describe(t) for t in hung[:2]]}"),
            check("what fails, fails with UNAVAILABLE (every request, before, during and after the outage)",
                  not not_unavailable, f"{len(not_unavailable)}: {[_describe(t) for t in not_unavailable[:2]]}"),
            check("the server is idle after the run", idle_s is not None, f"idle {idle_s} s after"),
            check("in-flight requests end within 2 s of the kill", all(end <= 2.0 for end in ends),
                  f"the last {max(ends, default=None)} s after", "target"),
            check("refusals while down name the stage", not unnamed and all(
                f"{stage} stage" in message for message in probe_errors),
                  f"{len(unnamed)} requests and {sum(f'{stage} stage' not in m for m in probe_errors)} probe messages "
                  f"do not: {[m for m in probe_errors if f'{stage} stage' not in m][:2]}", "target"),
            check("back and serving within 20 s", event.get("served_s") is not None and event["served_s"] <= 20,
                  f"{event.get('served_s')} s", "target"),
        ],
    }


def unexpected_around_kill(timings) -> list:
    """Every request of a kill scenario that ended otherwise than it may: completed, refused or failed with
    UNAVAILABLE (whenever it was sent: before the kill, while the stage was down, around its reload, after it),
    or with its own fate's code (a cancel or a deadline the scenario set)."""
    return [t for t in timings if not (ended_as_meant(t) or t.error_code == "UNAVAILABLE")]


def other_errors(timings, killed_at: float, limit: int = OTHER_ERRORS_KEPT) -> list[dict]:
    """The first ``limit`` requests (by send time) that failed with a code other than UNAVAILABLE: when each was
    sent and ended (seconds after the kill: negative before it), its code and its whole message."""
    rows = sorted((t for t in timings if not t.ok and t.error_code != "UNAVAILABLE"),
                  key=lambda t: (np.isnan(t.sent_at), t.sent_at))
    return [{"index": getattr(t, "index", None), "fate": fate_of(t), "sent_s": _after(t.sent_at, killed_at),
             "ended_s": _after(t.sent_at + t.total_s, killed_at), "code": t.error_code, "error": t.error}
            for t in rows[:limit]]


def _after(at: float, killed_at: float) -> float | None:
    return None if np.isnan(at) else round(at - killed_at, 2)


def _serving(probe: ServerProbe, stage: str) -> bool:
    """Whether ``stage`` holds a request now (its gauge: code2wav's open streams, the others' active requests)."""
    name = "omni_code2wav_streams" if stage == "code2wav" else "omni_active_requests"
    try:
        gauges = read_gauges(probe.metrics_url)
    except OSError:
        return False
    return any(value > 0 for key, value in gauges.items()
               if key.startswith(name + "{") and f"stage={stage}" in key.split("{", 1)[1].rstrip("}").split(","))


def _short(error: Exception) -> str:
    return _short_text(str(error))


def _short_text(text: str | None) -> str:
    """A message without the parts that differ per request (ids, pids), cut to a line."""
    return (text or "").split("\n")[0][:160]
