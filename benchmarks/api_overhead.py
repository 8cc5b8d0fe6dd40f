"""What the OpenAI-compatible API adds to time-to-first-audio: TTFA through `omni-triton api` (HTTP, SSE)
against TTFA straight over gRPC to the same tritonserver, side by side at each concurrency (issue 22: at most
5 ms added at p50).

The two systems take turns level by level, in rounds (order swapped every round), so that load from other
jobs on a shared machine falls on both alike. The API runs as its own process (`omni-triton api`), as deployed.

    # CPU, tiny checkpoint (built at checkpoints/tiny when missing); writes OUT/api_overhead.json
    python benchmarks/api_overhead.py --out benchmarks/results/cpu-tiny
    # GPU, full-size random weights; any `omni-triton bench` server option goes after --
    python benchmarks/api_overhead.py --out benchmarks/results/h200-api -- --device cuda --config qwen3_omni_30b_a3b
    # against a server that is already running
    python benchmarks/api_overhead.py --triton-grpc 127.0.0.1:8001 --checkpoint CKPT --out /tmp/api
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_triton.bench import cli as bench_cli  # noqa: E402
from omni_triton.bench import report as reporting  # noqa: E402
from omni_triton.bench.driver import run_level  # noqa: E402
from omni_triton.bench.metrics import percentile, summarize, ttfa, ttft  # noqa: E402
from omni_triton.bench.runners.openai_api import OpenAIApiRunner  # noqa: E402
from omni_triton.bench.runners.triton_stream import TritonStreamRunner  # noqa: E402
from omni_triton.bench.workload import QUICK, client_tensors, prompt_text, with_overrides  # noqa: E402
from omni_triton.launch.tritonserver import free_port  # noqa: E402

DEFAULT_TINY = Path("checkpoints/tiny")
API_LOG = Path("build/api_overhead_api.log")  # the API process's log: not a result


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-grpc", help="a running tritonserver's gRPC address (default: start one here)")
    parser.add_argument("--checkpoint", type=Path,
                        help=f"checkpoint of the served model: the prompt's tokenizer, and what a server started "
                             f"here serves (default: {DEFAULT_TINY}, built when missing)")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated levels (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per system and level (default: %(default)s)")
    parser.add_argument("--requests-per-round", type=int,
                        help="requests per system, level and round (default: 2 x concurrency, at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=QUICK.prompt_tokens,
                        help="user text tokens (default: %(default)s)")
    parser.add_argument("--thinker-tokens", type=int, default=QUICK.thinker_tokens,
                        help="thinker tokens per request, exact (default: %(default)s)")
    parser.add_argument("--audio-frames", type=int, default=QUICK.audio_frames,
                        help="codec frames per request, exact; 12.5 per second (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="directory for api_overhead.json")
    parser.add_argument("server_args", nargs="*",
                        help="after --: `omni-triton bench` options for the server started here (--device, "
                             "--config, --kv-cache-tokens, ...)")
    args = parser.parse_args(argv)
    args.levels = tuple(int(part) for part in args.concurrency.split(","))
    return args, args.server_args


def server_options(args: argparse.Namespace, server_args: list[str]) -> argparse.Namespace | None:
    """`omni-triton bench`'s options for the server started here (None: --triton-grpc names a running one);
    sets ``args.checkpoint`` to what it serves (a --config's random-weight checkpoint, or the tiny one)."""
    if args.triton_grpc:
        if args.checkpoint is None:
            raise SystemExit("--triton-grpc needs --checkpoint (the served checkpoint's tokenizer)")
        return None
    given = "--config" in server_args or args.checkpoint is not None
    if not given:
        from omni_triton.checkpoints.tiny import build

        args.checkpoint = DEFAULT_TINY if (DEFAULT_TINY / "config.json").is_file() else build(DEFAULT_TINY)
    checkpoint = [] if "--config" in server_args else ["--checkpoint", str(args.checkpoint)]
    bench_args = bench_cli.parse_args(["--start-server", *checkpoint, *server_args])
    args.checkpoint = bench_args.checkpoint
    return bench_args


@contextlib.contextmanager
def triton(args: argparse.Namespace, bench_args: argparse.Namespace | None, workload,
           notes: list[str]) -> Iterator[str]:
    if bench_args is None:
        yield args.triton_grpc
        return
    with bench_cli.served(bench_args, workload, notes) as url:
        yield url


@contextlib.contextmanager
def api_process(triton_grpc: str, checkpoint: Path, log_path: Path) -> Iterator[str]:
    """`omni-triton api` in front of ``triton_grpc``, in a process of its own; its base URL once healthy."""
    port = free_port()
    command = [sys.executable, "-m", "omni_triton.cli", "api", "--triton-grpc", triton_grpc, "--port", str(port),
               "--checkpoint", str(checkpoint), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=Path(__file__).resolve().parents[1])
    try:
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError(f"omni-triton api exited with {process.returncode}: see {log_path}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"omni-triton api not healthy after 60 s: see {log_path}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    bench_args = server_options(args, server_args)
    workload = with_overrides(QUICK, concurrencies=args.levels, prompt_tokens=args.prompt_tokens,
                              thinker_tokens=args.thinker_tokens, audio_frames=args.audio_frames)
    text = prompt_text(workload.prompt_tokens, args.checkpoint / "tokenizer.json")
    tensors = client_tensors(workload, text)
    args.out.mkdir(parents=True, exist_ok=True)
    API_LOG.parent.mkdir(parents=True, exist_ok=True)
    machine = reporting.machine_description()
    notes: list[str] = []
    timings: dict[tuple[str, int], list] = {}
    walls: dict[tuple[str, int], float] = {}
    with triton(args, bench_args, workload, notes) as grpc_url, \
            api_process(grpc_url, args.checkpoint, API_LOG) as api_url:
        runners = [TritonStreamRunner(grpc_url), OpenAIApiRunner(api_url)]
        for runner in runners:  # warm both paths (first requests compile, connect, fill caches)
            run_level(runner, tensors, 1, max(1, workload.warmup_requests))
        for round_index in range(args.rounds):
            order = runners if round_index % 2 == 0 else runners[::-1]
            for concurrency in args.levels:
                for runner in order:
                    level, wall_s = run_level(runner, tensors, concurrency,
                                              args.requests_per_round or max(16, 2 * concurrency))
                    key = ("grpc" if runner.name == "server" else "api", concurrency)
                    timings.setdefault(key, []).extend(level)
                    walls[key] = walls.get(key, 0.0) + wall_s
                    print(f"round {round_index + 1}/{args.rounds} c={concurrency} {key[0]}: "
                          f"TTFA p50 {ms(percentile([v for v in map(ttfa, level) if v is not None], 50))} ms",
                          file=sys.stderr, flush=True)

    rows = []
    for concurrency in args.levels:
        grpc = summarize("grpc", concurrency, timings["grpc", concurrency], walls["grpc", concurrency])
        api = summarize("api", concurrency, timings["api", concurrency], walls["api", concurrency])
        added = {q: None if a is None or g is None else a - g
                 for q, a, g in (("p50", api.ttfa_p50, grpc.ttfa_p50), ("p95", api.ttfa_p95, grpc.ttfa_p95))}
        rows.append({"concurrency": concurrency, "grpc": grpc.to_dict(), "api": api.to_dict(),
                     "ttfa_added_p50": added["p50"], "ttfa_added_p95": added["p95"],
                     "ttfa_s": {name: [ttfa(t) for t in timings[name, concurrency]] for name in ("grpc", "api")},
                     "ttft_s": {name: [ttft(t) for t in timings[name, concurrency]] for name in ("grpc", "api")}})

    table = ["| streams | requests (each) | gRPC TTFA p50 / p95 (ms) | API TTFA p50 / p95 (ms) | added p50 (ms) "
             "| added p95 (ms) | failed gRPC / API |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        grpc, api = row["grpc"], row["api"]
        table.append(f"| {row['concurrency']} | {grpc['requests']} | {ms(grpc['ttfa_p50'])} / {ms(grpc['ttfa_p95'])} "
                     f"| {ms(api['ttfa_p50'])} / {ms(api['ttfa_p95'])} | {ms(row['ttfa_added_p50'])} "
                     f"| {ms(row['ttfa_added_p95'])} | {grpc['failed']} / {api['failed']} |")
    print("\n".join(table))
    report = {"command": "python benchmarks/api_overhead.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "machine": machine, "checkpoint": str(args.checkpoint),
              "workload": {**workload.__dict__, "prompt_text": text}, "rounds": args.rounds,
              "requests_per_round": {c: args.requests_per_round or max(16, 2 * c) for c in args.levels},
              "notes": notes + ["TTFA: request sent -> first non-empty audio chunk at the client; gRPC: "
                                "OmniStreamClient, API: streamed chat completion over httpx (SSE), same server."],
              "rows": rows, "table": table}
    reporting.write_json(args.out / "api_overhead.json", report)
    print(f"wrote {args.out / 'api_overhead.json'}", file=sys.stderr)
    return 1 if any(row["grpc"]["failed"] or row["api"]["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
