"""perf_analyzer over gRPC streams at a concurrency range and a request-rate range, TTFA from its exports.

    python client/perf/run_perf_analyzer.py --url 127.0.0.1:8001 --checkpoint CKPT --quick \
        --models omni,thinker --concurrency 1,2,4 --request-rate 0.5,1,2 --out build/perf

Input data: client/perf/inputs/<model>.json (made for the tiny checkpoint and the --quick workload), or
generated for --checkpoint into <out>/inputs/. Each load point keeps its --profile-export-file JSON and log
under --out; summary.json and the printed table give per point: requests/s, latency to the first and last
response, and TTFT/TTFA from the per-response outputs (see omni_triton/bench/perf_analyzer.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omni_triton.bench.perf_analyzer import (PerfAnalyzerUnavailable, check_perf_analyzer, find_perf_analyzer,
                                             run_point)
from omni_triton.bench.perf_inputs import write_stage_inputs
from omni_triton.bench.workload import PRESETS, with_overrides

INPUTS_DIR = Path(__file__).parent / "inputs"
MODELS = ("omni", "preprocess", "thinker", "talker", "code2wav")


def _list(kind):
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC address (default %(default)s)")
    parser.add_argument("--models", type=_list(str), default=["omni"], help=f"comma-separated, of {MODELS}")
    parser.add_argument("--concurrency", type=_list(int), default=[1, 2, 4])
    parser.add_argument("--request-rate", type=_list(float), default=[0.5, 1.0, 2.0], help="requests/s")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per load point; 0: as many as the point's concurrency, at least 4 (the "
                             "export holds every response's audio, so a large count makes a large file; "
                             "default %(default)s)")
    parser.add_argument("--checkpoint", type=Path, help="generate the input data for this checkpoint")
    parser.add_argument("--quick", action="store_true", help="with --checkpoint: the --quick workload")
    parser.add_argument("--audio-frames", type=int, help="with --checkpoint: talker frames per request")
    parser.add_argument("--thinker-tokens", type=int, help="with --checkpoint: thinker tokens per request")
    parser.add_argument("--out", type=Path, default=Path("build/perf"))
    parser.add_argument("--audio-response", type=int, default=2,
                        help="TTFA = time to this response when the export holds no outputs (default %(default)s)")
    parser.add_argument("extra", nargs="*", help="more perf_analyzer arguments, after --")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")

    try:
        binary = find_perf_analyzer()
        check_perf_analyzer(binary)
    except PerfAnalyzerUnavailable as error:
        print(error, file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    inputs_dir = INPUTS_DIR
    if args.checkpoint is not None:
        workload = with_overrides(PRESETS["quick" if args.quick else "full"], audio_frames=args.audio_frames,
                                  thinker_tokens=args.thinker_tokens)
        inputs_dir = args.out / "inputs"
        write_stage_inputs(args.checkpoint, workload, inputs_dir)

    points = [{"concurrency": c} for c in args.concurrency] + [{"request_rate": r} for r in args.request_rate]
    summaries = []
    for model in args.models:
        for point in points:
            requests = args.requests or max(4, point.get("concurrency", 0))
            summary, export = run_point(binary, model, args.url, inputs_dir / f"{model}.json", args.out,
                                        requests=requests, extra=args.extra, **point)
            summaries.append(summary.to_dict() | {"export": str(export)})
            print(_row(summaries[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    print(f"wrote {args.out / 'summary.json'}", file=sys.stderr)
    return 0


def _row(s: dict) -> str:
    def ms(value):
        return "    -" if value is None else f"{value * 1000:5.0f}"
    return (f"{s['model']:>10} {s['mode']:>12}={s['value']:<5} n={s['requests']:<3} {s['requests_per_s']:6.2f} req/s "
            f"| first {ms(s['first_response_p50_s'])} ms | last p50 {ms(s['last_response_p50_s'])} ms "
            f"| TTFA p50 {ms(s['ttfa_p50_s'])} p95 {ms(s['ttfa_p95_s'])} ms ({s['ttfa_source']})")


if __name__ == "__main__":
    sys.exit(main())
