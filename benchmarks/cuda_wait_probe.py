"""Does a stage's wait for the GPU burn a CPU core while it waits? CPU time against wall time per wait.

    python benchmarks/cuda_wait_probe.py --out /tmp/cuda_wait_probe.json     # on the GPU machine

Why: the orchestrator and the stages wait for small GPU work many times a stream (a frame's owned copy on a side
stream then ``Stream.synchronize``, ``Tensor.cpu()`` of a chunk's audio, a step's ``Event.synchronize``). CUDA's
default scheduling (``cudaDeviceScheduleAuto``) spins a waiting thread while a process has fewer active contexts
than cores, so under load, when the GPU is busy with other processes' steps and a wait lasts milliseconds, a
spinning wait costs a core for all that time: at 64 streams the server's processes use ~9 of the H200 host's 16
cores (h200-orchestrator-x2). A wait through an event made with ``blocking=True`` sleeps instead. Each way is
timed with the GPU idle and with another process keeping it busy (``--load-s`` of bf16 matmuls), ``--waits`` each:
CPU microseconds (``time.thread_time``) against wall microseconds per wait, and their ratio (1.0: the thread spun
the whole wait).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def keep_busy(seconds: float) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def waits():
    """name -> a function doing one small piece of GPU work and waiting for it, as the stages do."""
    import torch

    device = torch.device("cuda")
    codes = torch.randint(0, 2048, (1, 1, 16), device=device)
    side = torch.cuda.Stream(device)
    blocking = torch.cuda.Event(blocking=True)

    def stream_synchronize():  # an owned copy on a side stream, then the stream's synchronize
        with torch.cuda.stream(side):
            codes.clone()
        side.synchronize()

    def blocking_event():  # the same copy, waited for through an event that sleeps
        with torch.cuda.stream(side):
            codes.clone()
        blocking.record(side)
        blocking.synchronize()

    def to_host():  # a device-to-host copy (a chunk's audio to the response)
        codes.cpu()

    return {"stream.synchronize": stream_synchronize, "blocking event": blocking_event, "tensor.cpu()": to_host}


def measure(wait, count: int) -> tuple[float, float]:
    for _ in range(10):
        wait()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(count):
        wait()
    return 1e6 * (time.thread_time() - cpu0) / count, 1e6 * (time.perf_counter() - wall0) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waits", type=int, default=300, help="waits timed per way and condition")
    parser.add_argument("--load-s", type=float, default=25.0, help="how long the other process keeps the GPU busy")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--keep-busy", type=float, help=argparse.SUPPRESS)  # the load process itself
    args = parser.parse_args()
    if args.keep_busy:
        keep_busy(args.keep_busy)
        return
    rows = []
    ways = waits()
    for condition in ("GPU idle", "GPU busy in another process"):
        load = None
        if condition != "GPU idle":
            load = subprocess.Popen([sys.executable, __file__, "--keep-busy", str(args.load_s)])
            time.sleep(5)  # its CUDA context up and its matmuls running
        for name, wait in ways.items():
            cpu_us, wall_us = measure(wait, args.waits)
            rows.append({"condition": condition, "wait": name, "cpu_us": round(cpu_us, 1), "wall_us": round(wall_us, 1),
                         "cpu_per_wall": round(cpu_us / wall_us, 3) if wall_us else None})
        if load is not None:
            load.wait()
    print("| condition | wait | CPU us | wall us | CPU / wall |\n|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['condition']} | {row['wait']} | {row['cpu_us']} | {row['wall_us']} | {row['cpu_per_wall']} |")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"rows": rows, "waits": args.waits}, out, indent=1)


if __name__ == "__main__":
    main()
