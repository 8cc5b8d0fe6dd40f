"""Soak the served pipeline with and without the workarounds for the bundled Triton 2.51 stub.

Each variant gets a fresh server (tiny checkpoint, CPU) and N streams that send requests back to back
until the time is up or the first request fails (a crash or a wedge: no response for --timeout-s). It
prints how many requests each variant served, what ended it, and whether the orchestrator's stub process
was still alive, and writes the same as JSON.

    python benchmarks/stub_workaround_soak.py --seconds 240 --out benchmarks/results/cpu-stub-soak.json

Variants: ``fixed`` (the default server), ``no-lock-fix`` (OMNI_TRITON_STUB_LOCK_FIX=0: the stub's
ResponseIterator lock-order deadlock is back), ``no-retirement`` (OMNI_TRITON_BLS_ITERATOR_RETIREMENT_S=0:
finished BLS iterators are dropped at once, so the stub's cleanup thread may free Python objects
without the GIL). See docs/python_backend.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

from omni_triton.client import OmniStreamClient
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.shared.stub_processes import find_stubs
from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port

VARIANTS = {
    "fixed": {},
    "no-lock-fix": {"OMNI_TRITON_STUB_LOCK_FIX": "0"},
    "no-retirement": {"OMNI_TRITON_BLS_ITERATOR_RETIREMENT_S": "0"},
}
MODELS = ["preprocess", "thinker", "talker", "code2wav", "orchestrator", "omni"]


def soak(variant: str, args: argparse.Namespace, run_dir: Path) -> dict:
    with mock.patch.dict(os.environ, VARIANTS[variant]):  # the server (and its stubs) inherit this environment
        config = LaunchConfig(checkpoint_dir=args.checkpoint, torch_threads={stage: 1 for stage in STAGES},
                              max_inflight_requests=args.streams)
        repository = render_repository(config, run_dir / "repository", MODELS)
        options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        server = TritonServer(repository, find_tritonserver(python_backend="bundled"), options,
                              log_path=run_dir / "tritonserver.log")
        server.start()
    try:
        server.wait_ready(MODELS, timeout_s=300)
        return _load(server, args)
    finally:
        server.stop()


def _load(server: TritonServer, args: argparse.Namespace) -> dict:
    stop = threading.Event()
    served = [0] * args.streams
    failures: list[tuple[float, str]] = []
    start = time.monotonic()

    def stream(index: int) -> None:
        with OmniStreamClient(server.grpc_url) as client:
            while not stop.is_set():
                request = served[index]
                try:
                    client.stream(f"Soak stream {index}, request {request}: tell me something.",
                                  timeout_s=args.timeout_s, temperature=0.0, max_tokens=8 + request % 5,
                                  max_audio_frames=16 + 4 * (request % 5), ignore_eos=True)
                except Exception as error:  # noqa: BLE001 - the first failure ends the variant
                    failures.append((time.monotonic() - start, f"{type(error).__name__}: {error}"[:300]))
                    stop.set()
                    return
                served[index] += 1

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    while not stop.wait(2.0) and time.monotonic() - start < args.seconds:
        print(f"  {time.monotonic() - start:5.0f} s  {sum(served)} requests", flush=True)
    stop.set()
    for thread in threads:
        thread.join(args.timeout_s + 10)
    orchestrator_alive = "orchestrator" in find_stubs(server.process.pid, ["orchestrator"])
    first = min(failures) if failures else None
    return {"requests": sum(served), "seconds": round(time.monotonic() - start, 1),
            "failed_after_s": None if first is None else round(first[0], 1),
            "failure": None if first is None else first[1], "orchestrator_stub_alive": orchestrator_alive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="checkpoints/tiny")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--seconds", type=float, default=180.0, help="per variant, unless it fails first")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="no response for this long = a wedge")
    parser.add_argument("--out", default="stub_workaround_soak.json")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="omni-soak-") as tmp:
        for variant in args.variants.split(","):
            print(f"{variant}: {args.streams} streams for up to {args.seconds:.0f} s", flush=True)
            run_dir = Path(tmp) / variant
            run_dir.mkdir()
            results[variant] = soak(variant, args, run_dir)
    print(f"\n{'variant':<14} {'requests':>8} {'seconds':>8}  {'orchestrator':<12} first failure")
    for variant, r in results.items():
        alive = "alive" if r["orchestrator_stub_alive"] else "DEAD"
        print(f"{variant:<14} {r['requests']:>8} {r['seconds']:>8.0f}  {alive:<12} {r['failure'] or '-'}")
    Path(args.out).write_text(json.dumps({"streams": args.streams, "seconds": args.seconds,
                                          "timeout_s": args.timeout_s, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
