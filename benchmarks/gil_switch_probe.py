"""How long a thread back from a wait with the GIL released waits to get it back from a thread busy in Python, by
GIL switch interval (``sys.setswitchinterval``, ``serve --gil-switch-interval-ms``).

An engine's step thread launches a step (Python, GIL held), then waits for its sampled ids (``Event.synchronize``:
the GIL released) while the stage's other threads (the response thread sending outputs, Triton's request threads)
run Python. When the wait ends the step thread asks for the GIL, and a busy holder hands it over only once the
switch interval has passed: up to 5 ms, Python's default, per step. This probe emulates the cycle on the CPU:
``--work-us`` of Python work, then ``--wait-ms`` asleep (the GIL released, as a GPU wait), alone and beside
``--busy-threads`` threads running Python, at each interval. Each cell: the mean cycle over ``--cycles``, the least
of ``--repeat`` runs.

    python benchmarks/gil_switch_probe.py --intervals-ms 5,1,0.5,0.2 --out-dir benchmarks/results/cpu-gil-switch
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path


def python_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def calibrate(work_us: float) -> int:
    """Loop iterations of ``python_work`` that take about ``work_us`` on this machine, alone."""
    iterations = 10_000
    start = time.perf_counter()
    python_work(iterations)
    per_iteration = (time.perf_counter() - start) / iterations
    return max(1, round(work_us * 1e-6 / per_iteration))


def cycle_ms(iterations: int, wait_s: float, cycles: int) -> float:
    """The mean time of one launch-then-wait cycle on this thread."""
    start = time.perf_counter()
    for _ in range(cycles):
        python_work(iterations)
        time.sleep(wait_s)  # releases the GIL, as a CUDA synchronize does
    return (time.perf_counter() - start) / cycles * 1e3


def measure(interval_ms: float, busy_threads: int, iterations: int, wait_ms: float, cycles: int) -> float:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1e3)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            python_work(1000)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(busy_threads)]
    try:
        for thread in threads:
            thread.start()
        return cycle_ms(iterations, wait_ms / 1e3, cycles)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(previous)


def run(intervals_ms: list[float], busy_threads: int, work_us: float, wait_ms: float, cycles: int,
        repeat: int) -> dict:
    iterations = calibrate(work_us)
    rows = []
    for interval in intervals_ms:
        alone = min(measure(interval, 0, iterations, wait_ms, cycles) for _ in range(repeat))
        beside = min(measure(interval, busy_threads, iterations, wait_ms, cycles) for _ in range(repeat))
        rows.append({"interval_ms": interval, "alone_ms": alone, "beside_busy_ms": beside,
                     "slowdown": beside / alone})
    return {"python": platform.python_version(), "machine": platform.machine(), "busy_threads": busy_threads,
            "work_us": work_us, "wait_ms": wait_ms, "cycles": cycles, "repeat": repeat, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"A cycle of {result['work_us']:.0f} us of Python work then {result['wait_ms']} ms waiting with the GIL "
             f"released, alone and beside {result['busy_threads']} thread(s) running Python (Python "
             f"{result['python']}, {result['machine']}; mean of {result['cycles']} cycles, least of "
             f"{result['repeat']} runs):", "",
             "| switch interval ms | cycle alone ms | beside busy ms | slowdown |", "|---:|---:|---:|---:|"]
    lines += [f"| {row['interval_ms']:g} | {row['alone_ms']:.2f} | {row['beside_busy_ms']:.2f} | "
              f"{row['slowdown']:.2f}x |" for row in result["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2",
                        help="switch intervals to try, ms (default %(default)s; 5 is Python's own)")
    parser.add_argument("--busy-threads", type=int, default=1)
    parser.add_argument("--work-us", type=float, default=500.0, help="Python work per cycle (default %(default)s)")
    parser.add_argument("--wait-ms", type=float, default=3.0, help="GIL-released wait per cycle (default %(default)s)")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, help="write gil_switch_probe.json and .md here")
    args = parser.parse_args(argv)
    try:
        intervals = [float(value) for value in args.intervals_ms.split(",")]
    except ValueError:
        parser.error(f"--intervals-ms: comma-separated numbers of ms, got {args.intervals_ms!r}")
    if any(value <= 0 for value in intervals) or args.cycles < 1 or args.repeat < 1 or args.busy_threads < 1:
        parser.error("--intervals-ms must be > 0; --cycles, --repeat and --busy-threads >= 1")
    result = run(intervals, args.busy_threads, args.work_us, args.wait_ms, args.cycles, args.repeat)
    text = markdown(result)
    print(text, end="")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "gil_switch_probe.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out_dir / "gil_switch_probe.md").write_text(text)
        print(f"wrote {args.out_dir}/gil_switch_probe.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
