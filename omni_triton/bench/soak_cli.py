"""`omni-triton bench --soak soak,burst,kill --goodput R`: issue 48's soak, burst and killed stages (bench.soak) at
fractions of a measured goodput, one report (results.json after every scenario, then results.md and soak.png).
The goodput to give is the mix's own (`bench --request-rate auto --mix`, the same mix options and --arrival-seed):
the mix's requests cost the server more than the fixed workload's, and fractions of the fixed workload's goodput
can overload it.

The soak and the burst share one server (--url, or one started here: the burst then finds it warm); each killed
stage gets a fresh server started here with --allow-stage-reload (the orchestrator reloads a dead thinker, talker
or code2wav), watched as `omni-triton serve` watches it (which reloads a dead orchestrator alone).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from omni_triton.bench import report as reporting
from omni_triton.bench import soak, soak_report
from omni_triton.bench.server_cpu import local_grpc_port
from omni_triton.bench.soak_probes import ServerProbe
from omni_triton.bench.soak_requests import RequestMix, SoakRunner, speakers_of
from omni_triton.load_timeline import reload_steps
from omni_triton.shared.placement import model_stage

SCENARIOS = ("soak", "burst", "kill")
STAGES = ("thinker", "talker", "code2wav", "orchestrator")


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(allowed)}")
        return names
    return parse


def _int_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected 0 < LOW <= HIGH, got {text!r}")
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "soak, burst, killed stages (instead of --concurrency: issue 48, benchmarks/README.md; also uses "
        "--arrival-seed, --arrivals, --drain-timeout, --max-client-streams)")
    group.add_argument("--soak", type=_names(SCENARIOS), metavar="SCENARIO[,...]",
                       help=f"run these of {','.join(SCENARIOS)}: an open-loop soak with cancels and deadlines, a "
                            "burst on the warm server, each --kill-stages stage killed under load on a fresh server "
                            "(kill needs --start-server)")
    group.add_argument("--goodput", type=float, metavar="R",
                       help="--soak: the measured goodput, requests/s (bench --request-rate auto --mix with the "
                            "same mix options: the goodput of the load soaked); every rate below is a multiple of it")
    group.add_argument("--soak-load", type=float, default=0.8, help="soak rate / goodput (default: %(default)s)")
    group.add_argument("--soak-duration", type=float, default=480.0, metavar="S",
                       help="seconds of soak arrivals (default: %(default)s)")
    group.add_argument("--ttfa-window", type=float, default=60.0, metavar="S",
                       help="TTFA p50/p95 per window of this many seconds, by send time (default: %(default)s)")
    group.add_argument("--sample-every", type=float, default=10.0, metavar="S",
                       help="sample each server process's RSS, threads and GPU memory this often (default: "
                            "%(default)s)")
    group.add_argument("--burst-load", type=float, default=4.0,
                       help="burst rate / goodput (default: %(default)s)")
    group.add_argument("--burst-seconds", type=float, default=5.0, metavar="S",
                       help="the burst's arrivals span this long (default: %(default)s)")
    group.add_argument("--burst-around", type=float, nargs=2, default=(10.0, 20.0), metavar=("BEFORE", "AFTER"),
                       help="seconds at --kill-load's rate before the burst (its normal TTFA) and after it (the "
                            "recovery) (default: 10 20)")
    group.add_argument("--normal-ttfa", type=float, default=1.5, metavar="X",
                       help="after the burst, TTFA is normal again within X times the p95 before it (default: "
                            "%(default)s)")
    group.add_argument("--kill-load", type=float, default=0.5,
                       help="rate while a stage is killed (and around the burst) / goodput (default: %(default)s)")
    group.add_argument("--kill-stages", type=_names(STAGES), default=STAGES, metavar="STAGE[,...]",
                       help=f"stages to kill, one fresh server each (default: {','.join(STAGES)})")
    group.add_argument("--kill-after", type=float, default=10.0, metavar="S",
                       help="seconds into the load the stub is killed (default: %(default)s)")
    group.add_argument("--kill-duration", type=float, default=40.0, metavar="S",
                       help="seconds of arrivals per killed stage (default: %(default)s)")
    group.add_argument("--back-timeout", type=float, default=180.0, metavar="S",
                       help="a killed stage not serving this long after its kill fails the scenario "
                            "(default: %(default)s)")
    group.add_argument("--metrics-url", help="the server's metrics endpoint (default: the started server's, else "
                                             "http://HOST:8002/metrics for --url HOST:PORT)")
    group = parser.add_argument_group(
        "the soak's request mix (--soak's, and --request-rate's with --mix: its goodput; seeded by --arrival-seed)")
    group.add_argument("--mix-thinker-tokens", type=_int_range, default=(10, 400), metavar="LOW-HIGH",
                       help="thinker tokens per request, drawn uniformly (default: 10-400)")
    group.add_argument("--mix-audio-frames", type=_int_range, default=(25, 500), metavar="LOW-HIGH",
                       help="audio frames (12.5 per second) per request, drawn uniformly (default: 25-500)")
    group.add_argument("--spoken-fraction", type=float, default=0.5,
                       help="requests with spoken input (16 kHz, 1-3 s) instead of text (default: %(default)s)")
    group.add_argument("--cancel-fraction", type=float, default=0.10,
                       help="requests the client cancels after their 1st-3rd audio chunk (default: %(default)s)")
    group.add_argument("--deadline-fraction", type=float, default=0.05,
                       help="requests with --deadline-s, at the longest lengths so that it expires "
                            "(default: %(default)s)")
    group.add_argument("--deadline-s", type=float, default=0.5, metavar="S",
                       help="their deadline_s parameter (default: %(default)s)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    conflicts = [flag for flag, given in (("--concurrency", args.concurrency), ("--merge", args.merge),
                                          ("--request-rate", args.request_rate), ("--trace", args.trace),
                                          ("--profile-stages", args.profile_stages)) if given is not None]
    if conflicts:
        parser.error(f"--soak runs its own scenarios: drop {', '.join(conflicts)}")
    if args.goodput is None or args.goodput <= 0:
        parser.error("--soak needs --goodput R > 0 (the measured goodput its rates are fractions of)")
    if "kill" in args.soak and not args.start_server:
        parser.error("--soak kill starts a fresh server per killed stage: it needs --start-server")
    for name in ("soak_load", "soak_duration", "ttfa_window", "sample_every", "burst_load", "burst_seconds",
                 "normal_ttfa", "kill_load", "kill_duration", "back_timeout", "deadline_s", "drain_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not 0 < args.kill_after < args.kill_duration:
        parser.error(f"--kill-after must be within --kill-duration, got {args.kill_after} and {args.kill_duration}")
    try:
        mix_of(args)
    except ValueError as error:
        parser.error(str(error))


def mix_of(args: argparse.Namespace) -> RequestMix:
    return RequestMix(thinker_tokens=args.mix_thinker_tokens, audio_frames=args.mix_audio_frames,
                      spoken_fraction=args.spoken_fraction, speakers=speakers_of(args.checkpoint),
                      cancel_fraction=args.cancel_fraction, deadline_fraction=args.deadline_fraction,
                      deadline_s=args.deadline_s, seed=args.arrival_seed)


def run(args: argparse.Namespace, workload, header: dict, notes: list[str], out_dir: Path,
        start_server: Callable[..., Any]) -> int:
    """Every scenario of ``args.soak``; the report goes into ``out_dir``. Exit status 1 when an invariant failed.
    ``start_server(args, workload, notes, run_dir, **server_options)``: a ready TritonServer (bench.cli's)."""
    mix = mix_of(args)
    rates = {"soak": args.goodput * args.soak_load, "burst": args.goodput * args.burst_load,
             "kill": args.goodput * args.kill_load}
    header = {key: value for key, value in header.items() if key not in ("workload", "prompt_ids")}
    report = {**header, "settings": {
        "goodput": args.goodput, "rates": rates, "mix": mix.describe(), "soak_duration_s": args.soak_duration,
        "ttfa_window_s": args.ttfa_window, "sample_every_s": args.sample_every, "burst_s": args.burst_seconds,
        "burst_around_s": list(args.burst_around), "normal_ttfa_x": args.normal_ttfa,
        "kill_stages": list(args.kill_stages) if "kill" in args.soak else [], "kill_after_s": args.kill_after,
        "kill_duration_s": args.kill_duration, "arrival_seed": args.arrival_seed, "arrivals": args.arrivals,
        "max_client_streams": args.max_client_streams, "drain_timeout_s": args.drain_timeout},
        "scenarios": {}, "notes": notes}

    def save(partial: bool = True) -> None:
        reporting.write_json(out_dir / "results.json", {**report, "partial": partial})

    def load_for(url: str) -> soak.LoadSettings:
        return soak.LoadSettings(url=url, mix=mix, seed=args.arrival_seed, max_in_flight=args.max_client_streams,
                                 drain_timeout_s=args.drain_timeout, arrivals=args.arrivals)

    idle_timeout_s = 30.0
    if {"soak", "burst"} & set(args.soak):
        server = start_server(args, workload, notes, Path("build/bench-run/soak")) if args.start_server else None
        url = server.grpc_url if server else args.url
        metrics_url = server.metrics_url if server else (args.metrics_url or _default_metrics_url(url))
        probe = ServerProbe(local_grpc_port(url), metrics_url)
        try:
            warm_up(url, mix, workload.warmup_requests)
            if "soak" in args.soak:
                print(f"soak at {rates['soak']:g} requests/s for {args.soak_duration:g} s", file=sys.stderr)
                report["scenarios"]["soak"] = soak.soak(load_for(url), probe, rates["soak"], args.soak_duration,
                                                        args.ttfa_window, args.sample_every, idle_timeout_s)
                save()
            if "burst" in args.soak:
                print(f"burst: {rates['burst']:g} requests/s for {args.burst_seconds:g} s", file=sys.stderr)
                report["scenarios"]["burst"] = soak.burst(load_for(url), probe, rates["kill"], args.burst_load
                                                          / args.kill_load, args.burst_seconds, *args.burst_around,
                                                          args.normal_ttfa, idle_timeout_s)
                save()
        finally:
            if server:
                server.stop()
    if "kill" in args.soak:
        report["scenarios"]["kill"] = []
        for stage in args.kill_stages:
            print(f"kill {stage} at {rates['kill']:g} requests/s", file=sys.stderr)
            report["scenarios"]["kill"].append(_kill_on_fresh_server(start_server, args, workload, notes, load_for,
                                                                     mix, stage, rates["kill"], idle_timeout_s))
            save()
    report["partial"] = False
    table, plot = soak_report.write(report, out_dir)
    print(table)
    print(f"wrote {out_dir}/results.json, results.md" + (f" ({plot})" if isinstance(plot, str) else f", {plot.name}"),
          file=sys.stderr)
    return 1 if soak_report.failed_invariants(report) else 0


def _kill_on_fresh_server(start_server, args, workload, notes, load_for, mix: RequestMix, stage: str, rate: float,
                          idle_timeout_s: float) -> dict:
    from omni_triton.launch.serve import STAGE_RELOADED
    from omni_triton.shared.stub_processes import find_stubs

    # exit_timeout_s: a killed stage's old model never unloads (its requests never end): don't wait for it at stop
    server = start_server(args, workload, notes, Path(f"build/bench-run/kill-{stage}"), stage_reload=True,
                          exit_timeout_s=2)
    stopping = threading.Event()
    restarts: list[tuple[float, str]] = []  # (time.perf_counter(), what serve's watch said)
    watcher = threading.Thread(target=server.supervise, name="serve-watch", daemon=True, kwargs=dict(
        ready_timeout_s=600, max_restarts=1, log=lambda line: restarts.append((time.perf_counter(), line)),
        reloaded_by_orchestrator=STAGE_RELOADED, stopped=stopping.is_set))
    watcher.start()
    try:
        warm_up(server.grpc_url, mix, workload.warmup_requests)
        probe = ServerProbe(local_grpc_port(server.grpc_url), server.metrics_url)

        def stub_pid() -> int | None:
            return find_stubs(server.process.pid, [stage]).get(stage) if server.process else None

        result = soak.kill_stage(load_for(server.grpc_url), probe, stage, stub_pid, rate, args.kill_duration,
                                 args.kill_after, args.back_timeout, idle_timeout_s)
        log = server.log_path.read_text(errors="replace").splitlines()
        killed = result.pop("killed_perf_counter", None)
        result["server_restarts"] = [f"{when - killed:+.1f} s: {line.splitlines()[0]}" if killed else line
                                     for when, line in restarts]
        result["reload_log"] = [line.strip()[-300:] for line in log if "stage reloaded in" in line
                                or "lock_exception" in line][:4]
        # the supervisor's reload line, as seconds after the kill: when the death was seen, the load asked, done
        killed_unix = result.pop("killed_unix", None)
        steps = (reload_steps(line, killed_unix) for line in log) if killed_unix else ()
        result["reload_steps"] = next((row for row in steps if row and model_stage(row["stage"])[0] == stage), None)
        # the stage's load timeline (load_timeline): at the server's start, then at its reload
        result["load_log"] = [line.strip()[-300:] for line in log if f"{stage}: loaded in" in line][:4]
        return result
    finally:
        stopping.set()
        watcher.join(5.0)
        server.stop()


def warm_up(url: str, mix: RequestMix, count: int) -> None:
    """A few requests of the mix, one at a time, not measured: the server's first-use paths run before the load."""
    worker = SoakRunner(url, time.perf_counter()).open_worker()
    try:
        for request in replace(mix, cancel_fraction=0.0, deadline_fraction=0.0).draw(count, first_index=10 ** 6):
            worker.request(request)
    finally:
        worker.close()


def _default_metrics_url(url: str) -> str:
    return f"http://{url.rpartition(':')[0]}:8002/metrics"
