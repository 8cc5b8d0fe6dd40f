"""How long a refused request waits for its UNAVAILABLE on a busy server (issue 48's burst: refused at once).

Starts a tritonserver on the CPU (tiny checkpoint) whose every admission slot holds a long stream
(``--admission-queue 0``, capacity off), then sends requests one at a time, text and spoken (2 s of audio: the
preprocess stage computes its features), each refused; prints the client's time from send to the error, per kind.
``--tree`` runs another checkout's code (its launcher and stages): the same measurement before and after a change.

    python benchmarks/refusal_latency.py --streams 4 --requests 30 [--tree /work/main]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def _tree() -> Path:
    if "--tree" in sys.argv:
        return Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_tree()))

import numpy as np  # noqa: E402

from omni_triton.checkpoints.tiny import build  # noqa: E402
from omni_triton.client import OmniStreamClient, StreamError  # noqa: E402
from omni_triton.launch.repository import render_repository  # noqa: E402
from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port  # noqa: E402
from omni_triton.shared.settings import STAGES, LaunchConfig  # noqa: E402

LONG = dict(max_tokens=12, max_audio_frames=4000, min_audio_frames=4000, ignore_eos=True, temperature=0.0)
SHORT = dict(max_tokens=8, max_audio_frames=25, ignore_eos=True, temperature=0.0)


def refusal_ms(url: str, spoken: bool) -> tuple[float, str]:
    audio = np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1 if spoken else None
    client = OmniStreamClient(url)
    try:
        start = time.perf_counter()
        try:
            client.stream("refuse me", audio_in=audio, timeout_s=60, **SHORT)
        except StreamError as error:
            return (time.perf_counter() - start) * 1e3, error.code
        return (time.perf_counter() - start) * 1e3, "OK"
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="--max-inflight, each slot held by a long stream")
    parser.add_argument("--requests", type=int, default=30, help="refused requests per kind (text, spoken)")
    parser.add_argument("--tree", help="the checkout whose code runs (default: this one)")
    args = parser.parse_args()
    os.chdir(_tree())  # the stubs import from their working directory first: the tree's code, not this one's
    run_dir = Path(tempfile.mkdtemp(prefix="refusal-latency-"))
    checkpoint = build(run_dir / "tiny")
    config = LaunchConfig(checkpoint_dir=checkpoint, max_inflight_requests=args.streams, admission_queue=0,
                          admission_capacity="off", kv_cache_tokens=4608 * args.streams, max_audio_seconds=3.0,
                          torch_threads={stage: 1 for stage in STAGES})
    repository = render_repository(config, run_dir / "repository")
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(repository, find_tritonserver(), options, log_path=run_dir / "tritonserver.log").start()
    clients = []
    try:
        server.wait_ready(timeout_s=300)
        url = server.grpc_url
        for index in range(args.streams):
            client = OmniStreamClient(url)
            clients.append(client)
            threading.Thread(target=lambda c=client, i=index: _play(c, i), daemon=True).start()
        time.sleep(3.0)  # every slot taken and streaming
        results = {"text": [], "spoken": []}
        for _ in range(args.requests):
            for kind in results:
                results[kind].append(refusal_ms(url, kind == "spoken"))
        print(f"tree {_tree()}: {args.streams} streams playing, {args.requests} refused requests per kind")
        print("| input | refused | p50 ms | p95 ms | max ms |\n|---|---:|---:|---:|---:|")
        for kind, rows in results.items():
            times = sorted(ms for ms, code in rows if code == "UNAVAILABLE")
            if not times:
                print(f"| {kind} | 0 of {len(rows)} | | | | codes {[code for _, code in rows]}")
                continue
            p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
            print(f"| {kind} | {len(times)} of {len(rows)} | {statistics.median(times):.1f} | {p95:.1f} | "
                  f"{times[-1]:.1f} |")
    finally:
        for client in clients:
            client.cancel()
        server.stop()


def _play(client, index: int) -> None:
    try:
        client.stream(f"a long story {index}", timeout_s=600, **LONG)
    except StreamError:
        pass


if __name__ == "__main__":
    main()
