"""Where a closed-loop level's request time went, from the bench client's own trace: waiting for the first audio
(TTFA: admission wait + the stream's start) against streaming after it (first audio to the last chunk).

In a closed loop at saturation every client sends its next request when the last one ends, so the time a request
takes is set by the server's throughput (``clients / requests per second``, Little's law); a server that streams
an admitted request's audio faster then shows a *longer* TTFA at the same throughput, the difference spent
waiting for admission. This prints both halves so two trees can be told apart on that:

    python benchmarks/closed_loop_split.py RUN_DIR [RUN_DIR ...]

RUN_DIR: a ``full_size_sweep.sh served`` output (``served/trace/server-c<N>/*.jsonl``, the events
``client.sent``, ``client.first_audio``, ``client.finished``), any folder holding such traces, or one
``server-c<N>`` folder. Prints a table
(seconds: mean and p50 per level) and writes them to ``closed_loop_split.json`` in the first RUN_DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def request_times(trace_dir: Path) -> list[dict[str, float]]:
    """Per finished request: {"ttfa", "streaming", "total"} seconds, from the client events in ``trace_dir``."""
    events: dict[str, dict[str, float]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                events.setdefault(event["id"], {})[event["event"]] = event["t"]
    times = []
    for marks in events.values():
        if {"client.sent", "client.first_audio", "client.finished"} <= marks.keys():
            sent, first, end = marks["client.sent"], marks["client.first_audio"], marks["client.finished"]
            times.append(dict(ttfa=first - sent, streaming=end - first, total=end - sent))
    return times


def summary(times: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {"requests": len(times)}
    for key in ("ttfa", "streaming", "total"):
        values = [t[key] for t in times]
        out[f"{key}_mean_s"] = statistics.mean(values)
        out[f"{key}_p50_s"] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        found = [run] if run.name.startswith("server-c") else run.rglob("server-c*")
        levels = sorted(found, key=lambda p: int(p.name.removeprefix("server-c")))
        if not levels:
            print(f"{run}: no client traces (server-c<N>/*.jsonl) found", file=sys.stderr)
            return 1
        for level in levels:
            times = request_times(level)
            if times:
                rows.append(dict(run=str(run), concurrency=int(level.name.removeprefix("server-c")), **summary(times)))
    print("| run | conc | requests | TTFA mean / p50 s | first audio to end mean / p50 s | total mean / p50 s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        halves = " | ".join(f"{r[key + '_mean_s']:.2f} / {r[key + '_p50_s']:.2f}"
                            for key in ("ttfa", "streaming", "total"))
        print(f"| {r['run']} | {r['concurrency']} | {r['requests']} | {halves} |")
    out = args.runs[0] / "closed_loop_split.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
