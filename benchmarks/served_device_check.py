"""Serve a checkpoint on a device, stream requests at a few concurrencies, and check where the
inter-stage tensors lived.

Prints TTFT/TTFA p50 per concurrency and the ``omni_interstage_host_tensors_total`` counters (all 0
means no stage-to-stage hop went through host memory), and writes the numbers as JSON.

    python benchmarks/served_device_check.py --device cuda --concurrency 1,8 --out served_cuda.json

``--entry orchestrator`` preprocesses in this process and streams to the orchestrator directly (no
BYTES inputs reach a Python stub): the tritonserver bundle's Python 3.12 stub garbles BYTES inputs on
the GPU machine (see README), while the GPU stage chain behind it is what this check is about.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omni_triton.client import OmniStreamClient
from omni_triton.server.repository import LaunchConfig, render_repository
from omni_triton.server.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port


def host_hop_counters(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {stage: float(value) for stage, value in
            re.findall(r'^omni_interstage_host_tensors_total\{stage="(\w+)"\} (\S+)$', text, re.M)}


class _PreprocessedInputs:
    """Turns client inputs into the orchestrator's inputs with the server's own Preprocessor."""

    def __init__(self, checkpoint: Path, kv_cache_tokens: int):
        from omni_triton.pipeline.preprocess import Preprocessor
        from omni_triton.pipeline.request_params import RequestLimits

        self.preprocessor = Preprocessor(checkpoint, RequestLimits(), kv_cache_tokens)

    def __call__(self, text: str, **scalars):
        import numpy as np
        import tritonclient.grpc as grpcclient

        from omni_triton.client import build_inputs

        client_inputs = {t.name(): _input_array(t) for t in build_inputs(text, **scalars)}
        inputs = []
        for name, array in self.preprocessor(client_inputs).items():
            array = np.ascontiguousarray(array)
            tensor = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs


def _input_array(tensor):
    import numpy as np
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    if tensor.datatype() == "BYTES":
        return deserialize_bytes_tensor(tensor._raw_content).reshape(tensor.shape())
    return np.frombuffer(tensor._raw_content, dtype=triton_to_np_dtype(tensor.datatype())).reshape(tensor.shape())


class StallWatchdog:
    """Calls ``on_stall`` once if ``progress()`` is not called for ``stall_s`` seconds."""

    def __init__(self, stall_s: float, on_stall):
        self._stall_s, self._on_stall = stall_s, on_stall
        self._last = time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while time.monotonic() - self._last < self._stall_s:
            time.sleep(1.0)
        self._on_stall()


def dump_stuck_server(server: TritonServer, out_dir: Path) -> None:
    """Where is everything waiting? Stacks of every stub (py-spy) and the gauges, then stop the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"stalled: dumping stub stacks and gauges to {out_dir}", flush=True)
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    (out_dir / "gauges.txt").write_text("\n".join(line for line in text.splitlines() if line.startswith("omni_")))
    py_spy = shutil.which("py-spy")
    stubs = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
    with open(out_dir / "stacks.txt", "w") as stacks:
        for pid in stubs:
            stacks.write(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200] + "\n")
            if py_spy:
                stacks.write(subprocess.run([py_spy, "dump", "--pid", pid], capture_output=True, text=True).stdout)
    server.stop()
    os._exit(3)


def run_level(grpc_url: str, concurrency: int, requests: int, workload: dict, preprocess=None,
              watchdog: StallWatchdog | None = None) -> dict:
    def one(index: int):
        result = _one(index)
        if watchdog is not None:
            watchdog.progress()
        return result

    def _one(index: int):
        text = f"Request number {index}: tell me something."
        if preprocess is None:
            with OmniStreamClient(grpc_url) as client:
                return client.stream(text, timeout_s=300, **workload)
        with OmniStreamClient(grpc_url, model="orchestrator") as client:
            return client.stream_inputs(preprocess(text, **workload), timeout_s=300)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    ttfa = [r.ttfa_s for r in results if r.ttfa_s is not None]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return {"concurrency": concurrency, "requests": requests, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttfa_p50_ms": 1e3 * statistics.median(ttfa), "ttfa_max_ms": 1e3 * max(ttfa),
            "rtf_mean": statistics.mean(r.rtf for r in results), "requests_per_s": requests / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint dir (default: build the tiny one)")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="engines' dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--interstage-memory", default="device", choices=["device", "host"],
                        help="host for Triton builds that cannot pass GPU tensors through decoupled BLS")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--entry", default="omni", choices=["omni", "orchestrator"])
    parser.add_argument("--out", default="served_device_check.json")
    parser.add_argument("--log", help="tritonserver log path (default: in a temporary directory)")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=60.0,
                        help="no request finished for this long: dump every stub's Python stacks (py-spy, if "
                             "installed) and the omni_* gauges next to --out, then stop (default: %(default)s)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="omni-served-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        from build_engines.tiny_checkpoint import build

        checkpoint = build(workdir / "tiny")
    config = LaunchConfig(checkpoint_dir=Path(checkpoint), device=args.device, dtype=args.dtype,
                          interstage_memory=args.interstage_memory,
                          max_inflight_requests=64)
    repository = render_repository(config, workdir / "repository")
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            gpu=args.device == "cuda", log_verbose=args.log_verbose)
    server = TritonServer(repository, find_tritonserver(), options,
                          log_path=args.log or workdir / "tritonserver.log")
    server.start()
    try:
        ready_s = server.wait_ready(timeout_s=600)
        watchdog = StallWatchdog(args.stall_s, lambda: dump_stuck_server(server, Path(args.out).with_suffix(".stuck")))
        workload = dict(temperature=0.0, max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True,
                        max_audio_frames=args.frames, min_audio_frames=args.frames)
        preprocess = (_PreprocessedInputs(Path(checkpoint), config.kv_cache_tokens)
                      if args.entry == "orchestrator" else None)
        run_level(server.grpc_url, 1, 2, workload, preprocess, watchdog)  # warm-up: first calls compile/allocate
        levels = [run_level(server.grpc_url, int(c), max(args.requests, int(c)), workload, preprocess, watchdog)
                  for c in args.concurrency.split(",")]
        hops = host_hop_counters(server.metrics_url)
    finally:
        server.stop()
    report = {"device": args.device, "dtype": config.resolved_dtype, "interstage_memory": args.interstage_memory, "entry": args.entry, "checkpoint": str(checkpoint), "ready_s": ready_s, "workload": workload,
              "levels": levels, "interstage_host_tensors": hops}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"ready in {ready_s:.1f} s on {args.device}")
    print("| concurrency | TTFT p50 ms | TTFA p50 ms | TTFA max ms | RTF mean | req/s |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        print(f"| {level['concurrency']} | {level['ttft_p50_ms']:.1f} | {level['ttfa_p50_ms']:.1f} | "
              f"{level['ttfa_max_ms']:.1f} | {level['rtf_mean']:.3f} | {level['requests_per_s']:.2f} |")
    print("inter-stage tensors received in host memory, by stage:", hops)


if __name__ == "__main__":
    main()
