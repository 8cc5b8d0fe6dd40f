"""`omni-triton bench`: the fixed workload over every system at every concurrency, one report.

    omni-triton bench --start-server --checkpoint CKPT --quick --out benchmarks/results/cpu-tiny
    omni-triton bench --url 127.0.0.1:8001 --checkpoint CKPT --concurrency 1,4,8,16,32,64
    omni-triton bench --start-server --device cuda --config qwen3_omni_30b_a3b --systems server,inprocess
    omni-triton bench --merge RUN_A RUN_B RUN_C --out benchmarks/results/h200-full [--label h200-full]
    omni-triton bench --start-server --device cuda --config qwen3_omni_30b_a3b --request-rate auto --goodput-start 4
    omni-triton bench --start-server --device cuda --config qwen3_omni_30b_a3b --soak soak,burst,kill --goodput 8

Systems: `server` (streaming, the system under test), `server-sequential` (same server, SEQUENTIAL=true),
`inprocess` (InProcessPipeline, no Triton), `transformers` (HF generate(return_audio=True), concurrency 1, not
streaming: its TTFA is its end-to-end time). The report gives each as a ratio to `server`. With --config
(random weights of a model config) the in-process pipeline and transformers build the same seeded weights as
the served stages (transformers: in bf16 on cuda, on the GPU directly; it holds the whole model, about 66 GiB
at full size, so run it alone, after the server has stopped); against a server started elsewhere (--url),
pass the --config/--dummy-* options it was started with.

--merge: one report from several runs' --out dirs (a sweep split into commands of a few minutes each: some
levels or some systems per command). It concatenates their rows, recomputes the ratios to `server`, re-plots,
and writes OUT/results.json (with `merged_from`: every run's dir, command, machine; every run's notes, KV plans
included) and OUT/results.md (every command listed). It refuses runs that measured the same system at the same
concurrency, runs whose workloads differ in prompt, thinker tokens or audio frames, and runs on another CPU or
GPU model (omni_triton/bench/merge.py).

--request-rate R[,R...]|auto: the open loop instead (bench/open_loop_cli.py): at each rate R, R x --duration arrivals
at uniform random times (a Poisson process given its count; --arrivals poisson: the free count of results before
that option, which offered more or less than R), each request on its own stream, and the goodput: the highest rate
with TTFA p95 <= 500 ms, no stream dry, none failed (bench/goodput.py); `auto` searches it.

--soak soak,burst,kill --goodput R: issue 48's soak (open loop at 0.8 R with a mixed, partly cancelled and expiring
load; errors by code, dry streams, TTFA drift, memory per process, nothing left behind), burst (4 R for 5 s) and
killed stages (each stage's stub killed at 0.5 R on a fresh server) (bench/soak_cli.py).

--trace DIR: every measured request is traced (omni_triton/trace.py) and the report gets, per system and level
(open loop: per rate), where the time to first audio went: client -> orchestrator, thinker queueing and prefill,
the first thinker chunk, talker queueing and prefill, the first chunk's frames, code2wav, the way back
(omni_triton/bench/breakdown.py). A server started here traces into DIR/server; one started elsewhere must have
been started with OMNI_TRITON_TRACE_DIR=DIR/server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from omni_triton import trace
from omni_triton.bench import breakdown, open_loop_cli, soak_cli
from omni_triton.bench import report as reporting
from omni_triton.bench.driver import run_level
from omni_triton.bench.gpu_memory import GpuMemoryPeak, gpu_memory_used_mib
from omni_triton.bench.metrics import LevelSummary, ratios_to, summarize
from omni_triton.bench.scheduler_stats import SchedulerStats
from omni_triton.bench.server_cpu import ServerCpu, ms_per_request
from omni_triton.bench.stage_profiles import ProfileWindows
from omni_triton.bench.workload import PRESETS, Workload, client_tensors, prompt_text, with_overrides
from omni_triton.launch.options import (LaunchOptionError, add_engine_arguments, add_load_arguments,
                                        add_memory_arguments, add_model_source_arguments, flag_settings,
                                        model_source, stage_instances, with_kv_budget)
from omni_triton.shared.placement import Placement
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stage_profile import PROFILE_DIR_ENV
from omni_triton.trace import TRACE_DIR_ENV

SYSTEMS = ("server", "server-sequential", "inprocess", "transformers")
REFERENCE = "server"
# The started server's requests in flight per stage under the open loop, whose in-flight count is not set by a
# --concurrency: the admission limit `omni-triton serve --max-inflight 64` is measured with (benchmarks/README.md).
OPEN_LOOP_MAX_INFLIGHT = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="omni-triton bench", description=__doc__.split("\n\n")[0])
    target = parser.add_argument_group("target")
    target.add_argument("--url", default="127.0.0.1:8001", help="running server's gRPC address (default %(default)s)")
    target.add_argument("--start-server", action="store_true",
                        help="render the repository for --checkpoint/--config and launch tritonserver for the run")
    target.add_argument("--checkpoint", type=Path,
                        help="checkpoint dir: needed (or --config) by --start-server, inprocess, transformers and "
                             "exact prompt length")
    target.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    target.add_argument("--tritonserver", help="tritonserver binary for --start-server (default: found)")
    target.add_argument("--max-inflight", type=int, metavar="N",
                        help="--start-server: the server's concurrent requests per stage (default: max(16, highest "
                             f"--concurrency); open loop: {OPEN_LOOP_MAX_INFLIGHT})")
    add_model_source_arguments(target)
    add_memory_arguments(target)
    add_engine_arguments(target)
    add_load_arguments(target)
    load = parser.add_argument_group("workload (defaults: the fixed workload of benchmarks/README.md, or --quick)")
    load.add_argument("--quick", action="store_true", help="CPU/CI preset: 16-token prompt, 16 tokens, 25 frames, "
                                                           "concurrency 1,2,4")
    load.add_argument("--concurrency", type=_int_list, help="comma-separated levels, e.g. 1,4,8")
    load.add_argument("--prompt-tokens", type=int)
    load.add_argument("--thinker-tokens", type=int)
    load.add_argument("--audio-frames", type=int)
    load.add_argument("--requests-per-level", type=int, help="default: 2 x concurrency, at least 4")
    load.add_argument("--warmup", type=int, dest="warmup_requests", help="uncounted requests per system")
    parser.add_argument("--systems", type=lambda text: text.split(","),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; open loop: server)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads in this process for inprocess/transformers (the server's stages "
                             "use 1 each by default)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="instead of running: merge these runs' --out dirs into --out (rows concatenated, ratios "
                             "and plots redone; refuses a level measured twice, other workload lengths, "
                             "another CPU/GPU)")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="trace every measured request (omni_triton.trace) under DIR and report where each "
                             "level's (open loop: each rate's) time to first audio goes: this process's events in "
                             "DIR/<system>-c<N> (open loop: DIR/<system>-r<R>), the server's in DIR/server (set for "
                             f"a --start-server server; start a server of your own with {TRACE_DIR_ENV}=DIR/server)")
    parser.add_argument("--profile-stages", type=Path, metavar="DIR",
                        help="a torch.profiler window (GPU kernels, host threads' CUDA waits) in every stage process, "
                             "--profile-delay seconds into each server level, into DIR/<system>-c<N>, summarised "
                             "in DIR/<system>-c<N>/stage_profiles.md (set for a --start-server server; start a "
                             f"server of your own with {PROFILE_DIR_ENV}=DIR)")
    parser.add_argument("--profile-delay", type=float, default=3.0, metavar="S",
                        help="seconds into a level a --profile-stages window starts (default %(default)s)")
    parser.add_argument("--profile-seconds", type=float, default=1.0, metavar="S",
                        help="length of each --profile-stages window (default %(default)s)")
    open_loop_cli.add_arguments(parser)
    soak_cli.add_arguments(parser)
    parser.add_argument("--out", type=Path, help="output dir (default benchmarks/results/<UTC time>)")
    parser.add_argument("--label", help="report title (default: the output dir's name)")
    args = parser.parse_args(argv)
    if args.request_rate is not None:
        open_loop_cli.check_arguments(parser, args)
        args.max_inflight = args.max_inflight or OPEN_LOOP_MAX_INFLIGHT
    if args.mix and args.request_rate is None:
        parser.error("--mix goes with --request-rate (--soak draws from the mix by itself)")
    if args.soak is not None:
        soak_cli.check_arguments(parser, args)
        args.max_inflight = args.max_inflight or OPEN_LOOP_MAX_INFLIGHT
    args.systems = args.systems or list(SYSTEMS)
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    if args.merge is not None:
        if args.out is None:
            parser.error("--merge needs --out (where the merged report goes)")
        running = [flag for flag, given in (("--start-server", args.start_server), ("--checkpoint", args.checkpoint),
                                            ("--config", args.config)) if given]
        if running:
            parser.error(f"--merge only merges finished runs: drop {', '.join(running)}")
    if args.start_server and args.checkpoint is None and args.config is None:
        parser.error("--start-server needs --checkpoint or --config")
    try:
        args.source = model_source(args) if args.checkpoint or args.config else None
    except LaunchOptionError as error:
        parser.error(str(error))
    if args.source is not None:
        args.checkpoint = args.source.checkpoint_dir
    return args


def launch_config(args: argparse.Namespace, workload: Workload, interstage_memory: str = "device",
                  gpu_processes: int | None = None) -> tuple[LaunchConfig, str]:
    """What the started server (and, with ``gpu_processes`` 1, the in-process pipeline) runs, with its KV
    budget and the note saying it. Enough engine slots for the highest level, so the launch config never caps
    the measured concurrency. The started server's stages are placed as `serve` places them by default (its
    GPU processes counted from that placement)."""
    config = LaunchConfig(**{
        # serve's settings by their shared flags; --torch-threads is this process's here, not the stages'
        **flag_settings(args, ignored=("torch_threads",)),
        "placement": Placement(instances=stage_instances(args.device, {})),
        "checkpoint_dir": args.source.checkpoint_dir.resolve(), "load_format": args.source.load_format,
        "dummy_seed": args.source.seed, "interstage_memory": interstage_memory,
        "max_inflight_requests": args.max_inflight or max(16, *workload.concurrencies)})
    return with_kv_budget(config, args.kv_cache_tokens, args.gpu_memory_utilization, gpu_processes)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


@contextlib.contextmanager
def served(args: argparse.Namespace, workload: Workload, notes: list[str]) -> Iterator[str]:
    """The server's gRPC address: --url, or a tritonserver launched here for the run and stopped after (its
    KV budget goes to ``notes``)."""
    if not args.start_server:
        yield args.url
        return
    server = start_server(args, workload, notes)
    try:
        yield server.grpc_url
    finally:
        server.stop()


def start_server(args: argparse.Namespace, workload: Workload, notes: list[str],
                 run_dir: Path = Path("build/bench-run"), **options):
    """A tritonserver for ``args`` launched here and ready (the caller stops it); ``options``: more
    ServerOptions (e.g. stage_reload). Its rendered repository and log go to ``run_dir``, not the results."""
    from omni_triton.launch.repository import available_models, render_repository
    from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port

    install = find_tritonserver(args.tritonserver, device=args.device)
    config, kv_note = launch_config(args, workload, install.interstage_memory(args.device))
    notes.append(f"server: {kv_note}")
    print(kv_note, file=sys.stderr)
    models = available_models()
    repository = render_repository(config, run_dir / "repository", models)
    server_options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                   gpu=args.device == "cuda", **options)
    server = TritonServer(repository, install, server_options, log_path=run_dir / "tritonserver.log")
    with (_environment(TRACE_DIR_ENV, str(args.trace / "server") if args.trace else None),
          _environment(PROFILE_DIR_ENV, str(args.profile_stages) if args.profile_stages else None)):
        server.start()  # its stage processes inherit the trace and profile directories
    try:
        print(f"tritonserver ready in {server.wait_ready(models, timeout_s=600):.1f} s at {server.grpc_url}",
              file=sys.stderr)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (None: left as it is) inside the block."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)


def make_runner(system: str, args: argparse.Namespace, url: str, workload: Workload, notes: list[str]):
    if system in ("server", "server-sequential"):
        from omni_triton.bench.runners.triton_stream import TritonStreamRunner
        return TritonStreamRunner(url, sequential=system == "server-sequential")
    if system == "inprocess":
        from omni_triton.bench.runners.inprocess import InProcessRunner

        config, kv_note = launch_config(args, workload, gpu_processes=1)
        notes.append(f"inprocess: {kv_note}")
        return InProcessRunner(config)
    from omni_triton.bench.runners.transformers_generate import TransformersRunner
    return TransformersRunner(args.checkpoint, args.device, random_weights=args.source.random_weights,
                              seed=args.source.seed)


def bench_system(runner, workload: Workload, text: str, trace_dir: Path | None = None,
                 breakdowns: list[dict] | None = None, after_level=lambda: None,
                 server_url: str | None = None, profile: "ProfileWindows | None" = None) -> list[LevelSummary]:
    """Every level of ``workload`` through ``runner``. With ``trace_dir``, each level's requests are traced
    and its TTFA breakdown row is appended to ``breakdowns``; ``after_level`` is called after each level with
    ``summaries`` (this system's so far) not yet returned: see main's ``save_partial``. With ``server_url`` (a
    server on this machine), each level also records its processes' CPU (bench.server_cpu), as % of a core and per
    completed request (printed too), and Triton's statistics per model (bench.scheduler_stats)."""
    from tqdm import tqdm

    tensors = client_tensors(workload, text, sequential=runner.sequential)
    levels = [c for c in workload.concurrencies if runner.max_concurrency is None or c <= runner.max_concurrency]
    if not levels:
        print(f"skipping {runner.name}: it runs at concurrency <= {runner.max_concurrency} only", file=sys.stderr)
        return []
    if workload.warmup_requests:
        run_level(runner, tensors, 1, workload.warmup_requests)
    summaries = []
    with tqdm(total=sum(workload.requests_at(c) for c in levels), desc=runner.name, unit="req") as progress:
        for concurrency in levels:
            progress.set_postfix(concurrency=concurrency)
            level_dir = trace_dir / f"{runner.name}-c{concurrency}" if trace_dir is not None else None
            with (trace.traced_into(level_dir), GpuMemoryPeak() as gpu_memory, ServerCpu(server_url) as server_cpu,
                  SchedulerStats(server_url) as scheduler,
                  profile.during(f"{runner.name}-c{concurrency}") if profile else contextlib.nullcontext()):
                timings, wall_s = run_level(runner, tensors, concurrency, workload.requests_at(concurrency),
                                            on_done=lambda _: progress.update())
            summary = summarize(runner.name, concurrency, timings, wall_s)
            cpu_ms = ms_per_request(server_cpu.seconds, summary.requests - summary.failed)
            summaries.append(replace(summary, gpu_memory_peak_gib=gpu_memory.gib,
                                     gpu_memory_peak_gib_per_gpu=gpu_memory.gib_per_gpu,
                                     server_cpu_pct=server_cpu.percent, server_cpu_ms_per_request=cpu_ms,
                                     triton_models=scheduler.summary))
            if cpu_ms:
                progress.write(f"{runner.name} c{concurrency}: server CPU ms per completed request: "
                               + ", ".join(f"{name} {value:.1f}" for name, value in cpu_ms.items()), file=sys.stderr)
            if level_dir is not None and breakdowns is not None:
                server_dir = trace_dir / "server" if runner.name.startswith("server") else None
                breakdowns.append(breakdown.level_row(runner.name, concurrency, level_dir, server_dir))
            after_level(summaries)
    return summaries


def merge_runs(args: argparse.Namespace) -> int:
    from omni_triton.bench.merge import MergeError, write_merged

    try:
        report, table = write_merged(args.merge, args.out, args.label, REFERENCE, SYSTEMS)
    except MergeError as error:
        print(f"omni-triton bench --merge: error: {error}", file=sys.stderr)
        return 2
    print(table)
    print(f"wrote {args.out}/results.json, results.md (merged {len(args.merge)} runs)", file=sys.stderr)
    rows = report["rates"] if "open_loop" in report else report["results"]
    return 1 if any(row["failed"] or row.get("not_started") for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge is not None:
        return merge_runs(args)
    base = PRESETS["quick" if args.quick else "full"]
    workload = with_overrides(base, concurrencies=args.concurrency, prompt_tokens=args.prompt_tokens,
                              thinker_tokens=args.thinker_tokens, audio_frames=args.audio_frames,
                              requests_per_level=args.requests_per_level, warmup_requests=args.warmup_requests)
    systems = [s for s in SYSTEMS if s in args.systems]
    notes: list[str] = []
    if args.checkpoint is None:
        local = [s for s in systems if s in ("inprocess", "transformers")]
        if local:
            print(f"skipping {local}: they need --checkpoint or --config", file=sys.stderr)
        systems = [s for s in systems if s not in local]
    if "transformers" in systems and args.source.random_weights:
        notes.append(f"transformers: random weights built from the same config.json with the same seed "
                     f"({args.source.seed}) and the served stages' per-tensor values, in the same dtype on the "
                     f"same device, so the same tensors (tests/test_transformers_random_baseline.py checks it on the CPU); "
                     f"its vision tower (not served) is extra.")
    out_dir = args.out or Path("benchmarks/results") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.checkpoint is not None:
        import torch

        torch.set_num_threads(args.torch_threads)  # the baselines run in this process
    tokenizer = args.checkpoint / "tokenizer.json" if args.checkpoint is not None else None
    text = prompt_text(workload.prompt_tokens, tokenizer)

    machine = reporting.machine_description()  # before the run: its load average is the other jobs'
    idle_gpu_mib = gpu_memory_used_mib()  # per GPU, before any system holds GPU memory (None: no GPU or nvidia-smi)
    summaries: list[LevelSummary] = []
    breakdowns: list[dict] = []

    header = {
        "label": args.label or out_dir.name,
        "command": "omni-triton bench " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "workload": {**workload.__dict__, "prompt_text": text},
        "prompt_ids": _prompt_ids(args.checkpoint, text),
        "gpu_memory_used_gib_at_start": None if idle_gpu_mib is None else round(sum(idle_gpu_mib) / 1024, 2),
        "weights": ({"checkpoint": str(args.source.checkpoint_dir), "load_format": args.source.load_format,
                     "seed": args.source.seed} if args.source is not None else "unknown"),
    }
    if args.request_rate is not None:
        with served(args, workload, notes) as url:
            return open_loop_cli.run(args, workload, text, url, header, notes, out_dir)
    if args.soak is not None:
        return soak_cli.run(args, workload, header, notes, out_dir, start_server)

    def build_report(rows: list[LevelSummary], complete: bool) -> dict:
        return {
            **header,
            "torch_threads": args.torch_threads,
            "results": [s.to_dict() for s in rows],
            "ratios_to": REFERENCE,
            "ratios": ratios_to(REFERENCE, rows),
            "ttfa_breakdown": breakdowns,
            "notes": notes + (["transformers generate() is not streaming: its TTFT and TTFA are its end-to-end time."]
                              if "transformers" in systems else [])
                     + ([] if complete else ["partial: the run stopped before its last level"]),
        }

    def save_partial(system_so_far: list[LevelSummary]) -> None:
        """After every level: a run cut short (a command's time limit) keeps what it measured."""
        reporting.write_json(out_dir / "results.json", build_report(summaries + system_so_far, complete=False))

    server_systems = [s for s in systems if s.startswith("server")]
    profile = (ProfileWindows(args.profile_stages, args.profile_delay, args.profile_seconds)
               if args.profile_stages else None)
    if server_systems:
        with served(args, workload, notes) as url:
            for system in server_systems:
                summaries += bench_system(make_runner(system, args, url, workload, notes), workload, text,
                                          args.trace, breakdowns, save_partial, server_url=url, profile=profile)
    if profile is not None:
        notes.extend(profile.summaries())
    for system in (s for s in systems if not s.startswith("server")):  # after the server stopped: free cores
        runner = make_runner(system, args, args.url, workload, notes)
        try:
            summaries += bench_system(runner, workload, text, args.trace, breakdowns, save_partial)
        finally:
            runner.close()

    report = build_report(summaries, complete=True)
    plots = reporting.plot(summaries, out_dir)
    if isinstance(plots, str):
        report["notes"].append(plots)
        print(plots, file=sys.stderr)
    reporting.write_json(out_dir / "results.json", report)
    table = reporting.markdown(report, summaries, report["ratios"], REFERENCE)
    table += breakdown.report_section(breakdowns)
    (out_dir / "results.md").write_text(table)
    print(table)
    print(f"wrote {out_dir}/results.json, results.md"
          + ("" if isinstance(plots, str) else "".join(f", {path.name}" for path in plots)), file=sys.stderr)
    return 1 if any(s.failed for s in summaries) else 0


def _prompt_ids(checkpoint: Path | None, text: str) -> int | str:
    """Prompt length after the chat template (what the thinker prefills), when the checkpoint is at hand."""
    if checkpoint is None:
        return "unknown"
    from omni_triton.pipeline.chat import ChatTokenizer

    return len(ChatTokenizer.from_checkpoint(checkpoint).encode_prompt(text, 0))


if __name__ == "__main__":
    sys.exit(main())
