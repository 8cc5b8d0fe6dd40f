"""How long a refused request waits for its UNAVAILABLE on a busy server (issue 48's burst: refused at once).

Starts a tritonserver on the CPU (tiny checkpoint) whose every admission slot holds a long stream
(``--admission-queue 0``, capacity off), then sends requests one at a time, text and spoken (2 s of audio: the
preprocess stage computes its features), each refused; prints the client's time from send to the error, per kind.
``--burst RATE``: instead, short requests (every other one spoken) arrive every 1/RATE s for ``--seconds`` at a server
of ``--streams`` slots and the default queue, so admitted and refused requests mix as in issue 48's burst; prints
the refusals by who decided them (preprocess, or the orchestrator after preprocess: its trace event
``orchestrator.received``), their times, and the admitted requests' first TTFA.
``--tree`` runs another checkout's code (its launcher and stages): the same measurement before and after a change.

    python benchmarks/refusal_latency.py --streams 4 --requests 30 [--tree /work/main]
    python benchmarks/refusal_latency.py --streams 16 --burst 40 --seconds 4 --rounds 2 [--tree /work/main]
"""

from __future__ import annotations

import argparse
import json
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

from omni_triton import trace  # noqa: E402
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
    parser.add_argument("--burst", type=float, help="requests/s of a burst of short requests (see above)")
    parser.add_argument("--seconds", type=float, default=4.0, help="the burst's length")
    parser.add_argument("--rounds", type=int, default=2, help="bursts, one after the other")
    parser.add_argument("--tree", help="the checkout whose code runs (default: this one)")
    args = parser.parse_args()
    os.chdir(_tree())  # the stubs import from their working directory first: the tree's code, not this one's
    run_dir = Path(tempfile.mkdtemp(prefix="refusal-latency-"))
    checkpoint = build(run_dir / "tiny")
    if args.burst:
        burst(args, checkpoint, run_dir)
        return
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


def burst(args, checkpoint: Path, run_dir: Path) -> None:
    trace_dir = run_dir / "trace"
    os.environ[trace.TRACE_DIR_ENV] = str(trace_dir)  # the server's stages inherit it
    trace.configure(trace_dir)
    config = LaunchConfig(checkpoint_dir=checkpoint, max_inflight_requests=args.streams, admission_capacity="off",
                          kv_cache_tokens=4608 * args.streams, max_audio_seconds=3.0,
                          torch_threads={stage: 1 for stage in STAGES})
    repository = render_repository(config, run_dir / "repository")
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(repository, find_tritonserver(), options, log_path=run_dir / "tritonserver.log").start()
    audio = np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1
    by_decider, first_audio = {"preprocess": [], "orchestrator": []}, []
    try:
        server.wait_ready(timeout_s=300)
        with OmniStreamClient(server.grpc_url) as client:  # warm
            client.stream("warm", audio_in=audio, timeout_s=120, **SHORT)
        for round_index in range(args.rounds):
            count = int(args.burst * args.seconds)
            clients = [OmniStreamClient(server.grpc_url) for _ in range(count)]  # streams open before the clock
            outcomes: dict[str, tuple[str, float, float | None]] = {}
            start = time.perf_counter() + 0.5
            threads = [threading.Thread(target=_burst_request, args=(
                clients[index], f"b{round_index}.{index}", start + index / args.burst,
                audio if index % 2 else None, outcomes)) for index in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            received = _received_ids(trace_dir)
            for request_id, (code, total_ms, ttfa_ms) in outcomes.items():
                if code == "UNAVAILABLE":
                    by_decider["orchestrator" if request_id in received else "preprocess"].append(total_ms)
                elif ttfa_ms is not None:
                    first_audio.append(ttfa_ms)
            time.sleep(1.0)
    finally:
        server.stop()
    print(f"tree {_tree()}: --max-inflight {args.streams}, {args.rounds} x {args.seconds:g} s of {args.burst:g} "
          f"requests/s; admitted TTFA min {min(first_audio, default=float('nan')):.1f} ms of {len(first_audio)}")
    print("| refused by | requests | p50 ms | p90 ms | max ms |\n|---|---:|---:|---:|---:|")
    for decider, times in by_decider.items():
        times.sort()
        if times:
            print(f"| {decider} | {len(times)} | {statistics.median(times):.1f} | {times[int(0.9 * len(times))]:.1f} | "
                  f"{times[-1]:.1f} |")
        else:
            print(f"| {decider} | 0 | | | |")


def _burst_request(client, request_id: str, due: float, audio, outcomes: dict) -> None:
    time.sleep(max(0.0, due - time.perf_counter()))
    start = time.perf_counter()
    try:
        result = client.stream(f"burst {request_id}", audio_in=audio, timeout_s=120, request_id=request_id,
                               min_audio_frames=25, **SHORT)
        outcomes[request_id] = ("OK", (time.perf_counter() - start) * 1e3, result.ttfa_s * 1e3)
    except StreamError as error:
        outcomes[request_id] = (error.code, (time.perf_counter() - start) * 1e3, None)
    finally:
        client.close()


def _received_ids(trace_dir: Path) -> set[str]:
    """Client request ids the orchestrator received (its ids are ``<client id>#...``)."""
    received = set()
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("event") == "orchestrator.received":
                received.add(entry["id"].split("#")[0])
    return received


def _play(client, index: int) -> None:
    try:
        client.stream(f"a long story {index}", timeout_s=600, **LONG)
    except StreamError:
        pass


if __name__ == "__main__":
    main()
