"""`omni-triton bench --request-rate R[,R...]|auto`: the open loop against one served system, its goodput, and
its report (results.json after every rate, then results.md and open_loop.png).

Every request is the fixed workload's, or with ``--mix`` one of the soak's request mix (bench.soak_requests): the
soak's own requests in its order (same seed, same options), so that ``--request-rate auto --mix`` finds the goodput
of the load the soak runs (``bench --soak --goodput R``). A request of the mix that fails as it was meant to (the
client cancelled it, its deadline expired) is not a failure there, as in the soak.

With ``--trace DIR`` each rate's requests are traced into ``DIR/<system>-r<R>`` (the closed loop's levels go to
``DIR/<system>-c<N>``) and the report gets the closed loop's TTFA breakdown, a column per rate
(bench/breakdown.py); the server's own events are in ``DIR/server``, shared by every rate and cut to a rate's
requests and window when read.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import replace
from pathlib import Path

from omni_triton import trace
from omni_triton.bench import breakdown, open_loop_report, soak_cli
from omni_triton.bench import report as reporting
from omni_triton.bench.driver import run_level
from omni_triton.bench.gpu_memory import GpuMemoryPeak
from omni_triton.bench.goodput import Search, highest_passing, verdict
from omni_triton.bench.open_loop import (ARRIVAL_COUNTS, EXACT, LATE_START_S, RateSummary, StreamPool, arrival_times,
                                         run_rate, summarize_rate)
from omni_triton.bench.runners.triton_stream import TritonStreamRunner
from omni_triton.bench.scheduler_stats import SchedulerStats
from omni_triton.bench.server_cpu import ServerCpu, ms_per_request
from omni_triton.bench.soak_requests import SoakRunner, ended_as_meant
from omni_triton.bench.workload import Workload, client_tensors

AUTO = "auto"


def request_rates(text: str) -> tuple[float, ...] | str:
    """--request-rate: ``auto`` or comma-separated rates > 0 (requests/s)."""
    if text == AUTO:
        return AUTO
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or comma-separated requests/s, got {text!r}") from None
    if min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def rate_trace_dir(trace_dir: Path, system: str, rate: float) -> Path:
    """Where one rate's requests are traced: ``DIR/server-r12`` for 12 requests/s (``DIR/server-c12`` would be
    the closed loop's 12 clients)."""
    return trace_dir / f"{system}-r{rate:g}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "open loop (instead of --concurrency: DESIGN.md section 6, benchmarks/README.md)")
    group.add_argument("--request-rate", type=request_rates, metavar="R[,R...]|auto",
                       help="arrivals at each rate (requests/s) for --duration (--arrivals), each request on its "
                            "own gRPC stream whatever is in flight; the goodput is the highest rate that passes. auto: "
                            "search it (from --goodput-start, doubling while a rate passes, halving while it fails, "
                            "then --goodput-bisections steps between the highest pass and the lowest fail) "
                            "(default: closed loop)")
    group.add_argument("--duration", type=float, default=30.0, metavar="S",
                       help="seconds of arrivals per rate (default: %(default)s)")
    group.add_argument("--arrival-seed", type=int, default=0,
                       help="seed of the arrival schedule, the same for every rate (exact: a rate's arrivals are a "
                            "lower rate's and some more; poisson: the same schedule played faster) "
                            "(default: %(default)s)")
    group.add_argument("--arrivals", choices=ARRIVAL_COUNTS, default=EXACT,
                       help="exact: round(R x --duration) arrivals at uniform random times (a Poisson process given "
                            "its count), so rate R offers R requests/s; poisson: a free count, exponential gaps of "
                            "mean 1/R (every result before this option: a sample offers more or less than R, e.g. 280 "
                            "arrivals in 20 s at 16/s with seed 0, 14/s); also the soak's (default: %(default)s)")
    group.add_argument("--ttfa-p95-limit-ms", type=float, default=500.0,
                       help="goodput criterion: a rate passes with TTFA p95 at most this, no stream dry (> 50 ms), "
                            "no request failed or unsent (default: %(default)s)")
    group.add_argument("--goodput-start", type=float, default=1.0, metavar="R",
                       help="--request-rate auto: the first rate tried (default: %(default)s)")
    group.add_argument("--goodput-max", type=float, default=256.0, metavar="R",
                       help="--request-rate auto: the highest rate tried (default: %(default)s)")
    group.add_argument("--goodput-bisections", type=int, default=3, metavar="N",
                       help="--request-rate auto: bisection steps after the doubling (default: %(default)s)")
    group.add_argument("--max-client-streams", type=int, default=512, metavar="N",
                       help="requests in flight at most on the client's side; an arrival past it is not sent and "
                            "fails its rate (default: %(default)s)")
    group.add_argument("--stop-after-fail", action="store_true",
                       help="with a list of rates: stop at the first that fails, in the order given (the rates after "
                            "it are skipped: on a busy machine they cost their duration and drain each)")
    group.add_argument("--drain-timeout", type=float, default=120.0, metavar="S",
                       help="after a rate's last arrival, wait this long for its requests; the ones still running "
                            "are cancelled and fail as DRAIN_TIMEOUT (default: %(default)s)")
    group.add_argument("--mix", action="store_true",
                       help="each request one of the soak's request mix (its options below, seeded by "
                            "--arrival-seed: the soak's own requests) instead of the fixed workload; a request "
                            "cancelled or expired as it was meant to is not a failure. With auto: the goodput of "
                            "the load `--soak` runs")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that do not go with the open loop, refused by name; --systems resolved to the one system."""
    conflicts = [flag for flag, given in (("--concurrency", args.concurrency), ("--merge", args.merge),
                                          ("--requests-per-level", args.requests_per_level))
                 if given is not None]
    if conflicts:
        parser.error(f"--request-rate runs the open loop: drop {', '.join(conflicts)} (closed-loop options)")
    systems = args.systems or ["server"]
    if len(systems) != 1 or systems[0] not in ("server", "server-sequential"):
        parser.error(f"--request-rate: --systems must be one of server, server-sequential (got {','.join(systems)})")
    args.systems = systems
    for name in ("duration", "drain_timeout", "ttfa_p95_limit_ms", "goodput_start", "goodput_max"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_client_streams < 1 or args.goodput_bisections < 0:
        parser.error("--max-client-streams must be >= 1 and --goodput-bisections >= 0")
    if args.stop_after_fail and args.request_rate == AUTO:
        parser.error("--stop-after-fail goes with a list of rates (--request-rate auto searches by itself)")
    if args.goodput_start > args.goodput_max:
        parser.error(f"--goodput-start {args.goodput_start} is above --goodput-max {args.goodput_max}")
    if args.mix:
        if args.systems != ["server"]:
            parser.error("--mix streams its requests: --systems must be server")
        try:
            soak_cli.mix_of(args)
        except ValueError as error:
            parser.error(str(error))


def run(args: argparse.Namespace, workload: Workload, text: str, url: str, header: dict, notes: list[str],
        out_dir: Path) -> int:
    """The open loop of ``args`` against the server at ``url``; writes the report into ``out_dir``. Exit status
    1 when any request failed or was not sent."""
    mix = soak_cli.mix_of(args) if args.mix else None
    runner = (SoakRunner(url, time.perf_counter()) if mix is not None
              else TritonStreamRunner(url, sequential=args.systems[0] == "server-sequential"))
    tensors = None if mix is not None else client_tensors(workload, text, sequential=runner.sequential)
    drawn: list = []  # the mix's requests drawn so far: every rate's schedule starts with the same ones
    limit_s = args.ttfa_p95_limit_ms / 1000
    rows: list[RateSummary] = []
    breakdowns: list[dict] = []  # with --trace: a TTFA breakdown per rate
    search = (Search(start=args.goodput_start, max_rate=args.goodput_max, min_rate=min(0.125, args.goodput_start),
                     bisections=args.goodput_bisections) if args.request_rate == AUTO else None)
    # the closed loop's levels are not this run's
    header = {**header, "workload": {key: value for key, value in header["workload"].items()
                                     if key not in ("concurrencies", "requests_per_level")}}
    settings = {"system": runner.name, "duration_s": args.duration, "arrival_seed": args.arrival_seed,
                "arrivals": args.arrivals, "max_client_streams": args.max_client_streams,
                "drain_timeout_s": args.drain_timeout, "late_start_s": LATE_START_S,
                **({"mix": mix.describe()} if mix is not None else {})}

    def build_report() -> dict:
        tried = [(row.rate, row.verdict is None) for row in rows]
        goodput = {"system": runner.name, "requests_per_s": highest_passing(dict(tried)), "ttfa_p95_limit_s": limit_s,
                   "tried": tried,
                   "search": None if search is None else {"start": search.start, "max_rate": search.max_rate,
                                                          "min_rate": search.min_rate,
                                                          "bisections": search.bisections}}
        return {**header, "open_loop": settings, "goodput": goodput, "rates": [row.to_dict() for row in rows],
                "ttfa_breakdown": breakdowns, "notes": notes + _goodput_notes(search, goodput)}

    def measure(rate: float) -> bool:
        arrivals = arrival_times(rate, args.duration, args.arrival_seed, args.arrivals)
        print(f"{runner.name} at {rate:g} requests/s: {len(arrivals)} arrivals over {args.duration:g} s",
              file=sys.stderr)
        if mix is not None and len(drawn) < len(arrivals):
            drawn.extend(mix.draw(len(arrivals) - len(drawn), first_index=len(drawn)))
        requests = drawn.__getitem__ if mix is not None else tensors
        rate_dir = rate_trace_dir(args.trace, runner.name, rate) if args.trace is not None else None
        # (without --trace, this process's tracing is left as it is)
        traced = trace.traced_into(rate_dir) if rate_dir is not None else contextlib.nullcontext()
        with traced, GpuMemoryPeak() as gpu_memory, ServerCpu(url) as server_cpu, SchedulerStats(url) as scheduler:
            rate_run = run_rate(pool, requests, arrivals, max_in_flight=args.max_client_streams,
                                drain_timeout_s=args.drain_timeout)
        if rate_dir is not None:
            breakdowns.append(breakdown.rate_row(runner.name, rate, rate_dir, args.trace / "server"))
        row = summarize_rate(runner.name, rate, args.duration, rate_run,
                             ended_as_meant if mix is not None else None)
        row.metrics = replace(row.metrics, gpu_memory_peak_gib=gpu_memory.gib,
                              gpu_memory_peak_gib_per_gpu=gpu_memory.gib_per_gpu, server_cpu_pct=server_cpu.percent,
                              server_cpu_ms_per_request=ms_per_request(server_cpu.seconds, row.completed),
                              triton_models=scheduler.summary)
        row.verdict = verdict(row, limit_s)
        rows.append(row)
        print(f"  {row.completed}/{row.sent} completed, TTFA p50/p95 {reporting.ms(row.metrics.ttfa_p50)}/"
              f"{reporting.ms(row.metrics.ttfa_p95)} ms, ran dry {row.metrics.ran_dry}, "
              f"{row.metrics.requests_per_s:.2f} req/s: {'pass' if row.verdict is None else row.verdict}",
              file=sys.stderr)
        reporting.write_json(out_dir / "results.json", {**build_report(), "partial": True})  # a cut-short run
        return row.verdict is None

    if workload.warmup_requests:
        if mix is not None:
            soak_cli.warm_up(url, mix, workload.warmup_requests)
        else:
            run_level(runner, tensors, 1, workload.warmup_requests)
    pool = StreamPool(runner)
    try:
        if search is not None:
            search.run(measure)
        else:
            for index, rate in enumerate(args.request_rate):
                if not measure(rate) and args.stop_after_fail:
                    skipped = args.request_rate[index + 1:]
                    if skipped:
                        notes.append(f"--stop-after-fail: {rate:g}/s failed, so {', '.join(f'{r:g}' for r in skipped)}"
                                     "/s were not run")
                    break
    finally:
        pool.close()

    table, plot = open_loop_report.write(build_report(), out_dir)
    print(table)
    print(f"wrote {out_dir}/results.json, results.md" + (f" ({plot})" if isinstance(plot, str) else f", {plot.name}"),
          file=sys.stderr)
    return 1 if any(row.failed_by_code or row.not_started for row in rows) else 0


def _goodput_notes(search: Search | None, goodput: dict) -> list[str]:
    """What the goodput figure cannot say by itself: a search stopped at its ceiling, a failing rate below it."""
    found = goodput["requests_per_s"]
    if found is None:
        return []
    notes = []
    if search is not None and found >= search.max_rate:
        notes.append(f"goodput search stopped at --goodput-max {search.max_rate:g}: the goodput may be higher")
    below = sorted(rate for rate, ok in goodput["tried"] if not ok and rate < found)
    if below:
        notes.append(f"rates below the goodput failed ({', '.join(f'{rate:g}' for rate in below)}/s): the verdicts "
                     "are not monotone in the rate (noise near the limit, or a --duration too short for the p95)")
    return notes
