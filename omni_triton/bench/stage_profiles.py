"""Summaries of the stage processes' profiler windows (``stage_profile.py``): where each process's GPU and host
threads spent one window of serving.

    python -m omni_triton.bench.stage_profiles DIR [--out DIR]

For each Chrome trace in DIR: the GPU's busy share (the union of kernel and memcpy intervals over the window),
the kernels that took most of it, and per host thread the CUDA runtime calls that block it (stream, event and
device synchronisations, blocking copies), which is where a hand-off between processes waits. Prints a table
and writes ``stage_profiles.json`` / ``stage_profiles.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterator

from omni_triton.stage_profile import request_window

BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                  "cudaMemcpyAsync")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(trace: dict, top: int = 5) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"window_ms": 0.0, "gpu_busy_pct": 0.0, "kernels": 0, "top_kernels": [], "threads": {}}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    window = max(end - start, 1e-9)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    kernel_time = Counter()
    for e in gpu:
        kernel_time[e["name"][:80]] += e["dur"]
    threads: dict[str, Counter] = defaultdict(Counter)
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"].startswith(BLOCKING_CALLS):
            threads[str(e.get("tid"))][e["name"]] += e["dur"]
    return {
        "window_ms": window / 1e3,
        "gpu_busy_pct": 100.0 * busy_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / window,
        "kernels": sum(e.get("cat") == "kernel" for e in gpu),
        "top_kernels": [{"name": name, "ms": us / 1e3} for name, us in kernel_time.most_common(top)],
        "threads": {tid: {call: us / 1e3 for call, us in calls.most_common()} for tid, calls in threads.items()},
    }


def summarize_dir(directory: Path) -> dict[str, dict]:
    return {path.stem: summarize(json.loads(path.read_text())) for path in sorted(directory.glob("*.json"))
            if path.name != "stage_profiles.json"}


def markdown(summaries: dict[str, dict]) -> str:
    lines = ["| process | window ms | GPU busy % | kernels | top kernels (ms) | host waits per thread (ms) |",
             "|---|---:|---:|---:|---|---|"]
    for name, s in summaries.items():
        kernels = "; ".join(f"{k['name'][:40]} {k['ms']:.1f}" for k in s["top_kernels"][:3])
        waits = "; ".join(f"{tid}: " + ", ".join(f"{call} {ms:.1f}" for call, ms in calls.items())
                          for tid, calls in s["threads"].items())
        lines.append(f"| {name} | {s['window_ms']:.0f} | {s['gpu_busy_pct']:.1f} | {s['kernels']} | {kernels} | "
                     f"{waits} |")
    return "\n".join(lines) + "\n"


class ProfileWindows:
    """The bench's ``--profile-stages``: one window ``delay_s`` into each level (by its label), then summaries."""

    def __init__(self, directory: Path, delay_s: float, seconds: float, settle_s: float = 30.0):
        self.directory, self.delay_s, self.seconds, self.settle_s = Path(directory), delay_s, seconds, settle_s
        self.labels: list[str] = []

    @contextlib.contextmanager
    def during(self, label: str) -> Iterator[None]:
        timer = threading.Timer(self.delay_s, request_window, (self.directory, label, self.seconds))
        timer.start()
        try:
            yield
        finally:
            timer.cancel()  # a level shorter than the delay gets no window
            self.labels.append(label)

    def summaries(self) -> list[str]:
        """Each window's summary (written beside its traces), once the stages wrote their traces."""
        notes = []
        for label in self.labels:
            window = self.directory / label
            deadline = time.monotonic() + self.settle_s
            while not any(window.glob("*.json")) and time.monotonic() < deadline:
                time.sleep(0.5)  # a stage writes its trace when its window ends
            time.sleep(min(2.0, self.settle_s))  # the other stages' traces, written at the same time
            traces = [path for path in window.glob("*.json") if path.name != "stage_profiles.json"]
            if not traces:
                notes.append(f"stage profile {label}: no trace (level shorter than the profile delay?)")
                continue
            summaries = summarize_dir(window)
            (window / "stage_profiles.json").write_text(json.dumps(summaries, indent=1))
            (window / "stage_profiles.md").write_text(markdown(summaries))
            busy = ", ".join(f"{name.split('-')[0]} {s['gpu_busy_pct']:.0f}%" for name, s in summaries.items())
            notes.append(f"stage profile {label} ({window}): GPU busy {busy}")
        return notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="OMNI_TRITON_PROFILE_DIR of a served run")
    parser.add_argument("--out", type=Path, default=None, help="where to write the summary (default: DIRECTORY)")
    args = parser.parse_args(argv)
    summaries = summarize_dir(args.directory)
    out = args.out or args.directory
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage_profiles.json").write_text(json.dumps(summaries, indent=1))
    table = markdown(summaries)
    (out / "stage_profiles.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
