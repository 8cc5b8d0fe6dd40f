"""Serve a checkpoint on a device, stream requests at a few concurrencies, and check where the
inter-stage tensors lived.

Prints TTFT/TTFA p50 per concurrency and the ``omni_interstage_host_tensors_total`` counters (all 0
means no stage-to-stage hop went through host memory), and writes the numbers as JSON. With
``--compare-inprocess`` every served stream is checked against the in-process pipeline (same code, no
Triton) run alone with the same seed: text equal, audio within ``--audio-atol``. With ``--soak-s`` it then
keeps ``--soak-concurrency`` streams going for that long, sampling GPU and host memory.

With ``--url`` it checks a server that is already running (e.g. the full-size server a benchmark just loaded)
instead of starting its own; its counters then cover everything that server served. ``--audio-out`` saves every
served stream's text and audio; ``--compare-audio`` checks them against a file an earlier run saved (same seeds):
how one placement of the stages is shown to serve what another served, e.g. GPUs split against one GPU.

    python benchmarks/served_device_check.py --device cuda --concurrency 1,8,32 --compare-inprocess \
        --dtype float32 --out served_cuda.json
    python benchmarks/served_device_check.py --device cuda --concurrency 8 --soak-s 360 --out soak.json
    python benchmarks/served_device_check.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
        --concurrency 1 --requests 4 --audio-out one_gpu.npz --out one_gpu.json   # then, served split:
    python benchmarks/served_device_check.py --url ... --compare-audio one_gpu.npz --out split.json

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

from omni_triton.bench.gpu_memory import gpu_memory_used_mib
from omni_triton.client import OmniStreamClient
from omni_triton.launch.options import add_placement_arguments, placement
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.launch.tritonserver import (ServerOptions, TritonServer, find_tritonserver, free_port,
                                             process_tree_rss_bytes)


def host_hop_counters(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counters: dict[str, float] = {}  # summed over a stage's replicas (their model_instance label)
    for labels, value in re.findall(r'^omni_interstage_host_tensors_total\{([^}]*)\} (\S+)$', text, re.M):
        stage = re.search(r'stage="(\w+)"', labels).group(1)
        counters[stage] = counters.get(stage, 0.0) + float(value)
    return counters


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
        self._cancelled = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def progress(self, stall_s: float | None = None) -> None:
        """Progress was made; ``stall_s`` sets a new allowance from now on (e.g. for a soak)."""
        self._last = time.monotonic()
        self._stall_s = stall_s or self._stall_s

    def cancel(self) -> None:
        self._cancelled.set()

    def _watch(self) -> None:
        while time.monotonic() - self._last < self._stall_s:
            if self._cancelled.wait(1.0):
                return
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


def request_text(index: int) -> str:
    return f"Request number {index}: tell me something."


def run_level(grpc_url: str, concurrency: int, requests: int, workload: dict, preprocess=None,
              watchdog: StallWatchdog | None = None, results_out: list | None = None) -> dict:
    def one(index: int):
        result = _one(index)
        if watchdog is not None:
            watchdog.progress()
        return result

    def _one(index: int):
        text = request_text(index)
        scalars = dict(workload, seed=index)
        if preprocess is None:
            with OmniStreamClient(grpc_url) as client:
                return client.stream(text, timeout_s=300, **scalars)
        with OmniStreamClient(grpc_url, model="orchestrator") as client:
            return client.stream_inputs(preprocess(text, **scalars), timeout_s=300)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    if results_out is not None:
        results_out.extend(results)
    ttfa = [r.ttfa_s for r in results if r.ttfa_s is not None]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return {"concurrency": concurrency, "requests": requests, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttfa_p50_ms": 1e3 * statistics.median(ttfa), "ttfa_max_ms": 1e3 * max(ttfa),
            "rtf_mean": statistics.mean(r.rtf for r in results), "requests_per_s": requests / wall}


def compare_inprocess(checkpoint: Path, config: LaunchConfig, workload: dict, served: dict[int, list],
                      audio_atol: float) -> dict:
    """Each served stream against the in-process pipeline run alone with the same text and seed."""
    import numpy as np
    import torch

    from omni_triton.client import build_inputs
    from omni_triton.pipeline.inprocess import InProcessPipeline

    from omni_triton.engine import EngineConfig

    dtype = getattr(torch, config.resolved_dtype)
    engine = EngineConfig(num_blocks=1024, device=config.device, kv_dtype=dtype, fast_path=config.fast_path,
                          cuda_graphs=config.cuda_graphs)  # the served engines' settings
    pipeline = InProcessPipeline(checkpoint, device=config.device, dtype=dtype, engine_config=engine)
    reference = {}
    try:
        for index in sorted({i for results in served.values() for i in range(len(results))}):
            inputs = {t.name(): _input_array(t) for t in build_inputs(request_text(index), **dict(workload, seed=index))}
            text, audio = "", []
            for delta, chunk in pipeline.stream(inputs):
                text += delta
                if chunk is not None and chunk.numel():
                    audio.append(chunk.float().cpu().numpy())
            reference[index] = (text, np.concatenate(audio) if audio else np.zeros(0, np.float32))
    finally:
        pipeline.close()
    return compare_streams(served, lambda concurrency, index: reference[index], audio_atol)


def save_streams(path: Path, served: dict[int, list]) -> None:
    """Every served stream's audio and text, keyed ``c<concurrency>_r<request>`` (request i has seed i)."""
    import numpy as np

    arrays = {}
    for concurrency, results in served.items():
        for index, result in enumerate(results):
            arrays[f"c{concurrency}_r{index}_audio"] = result.audio
            arrays[f"c{concurrency}_r{index}_text"] = np.array(result.text)
    np.savez_compressed(path, **arrays)


def compare_saved_streams(path: Path, served: dict[int, list], audio_atol: float) -> dict:
    """Each served stream against the one with the same concurrency and seed that ``save_streams`` wrote."""
    import numpy as np

    saved = np.load(path)

    def reference(concurrency: int, index: int):
        key = f"c{concurrency}_r{index}"
        return (str(saved[f"{key}_text"]), saved[f"{key}_audio"]) if f"{key}_audio" in saved else None

    return compare_streams(served, reference, audio_atol)


def compare_streams(served: dict[int, list], reference, audio_atol: float) -> dict:
    """Per concurrency: how many served streams have the text and (same length, within ``audio_atol``) the audio
    of ``reference(concurrency, index)`` -> (text, audio), or None where there is none (counted unequal)."""
    import numpy as np

    report = {}
    for concurrency, results in served.items():
        text_equal, audio_equal, worst = 0, 0, 0.0
        for index, result in enumerate(results):
            expected = reference(concurrency, index)
            if expected is None:
                worst = float("inf")
                continue
            text, audio = expected
            text_equal += result.text == text
            same_length = len(result.audio) == len(audio)
            diff = float(np.abs(result.audio - audio).max()) if same_length and len(audio) else float("inf")
            audio_equal += same_length and diff <= audio_atol
            worst = max(worst, diff)
        report[concurrency] = {"streams": len(results), "text_equal": text_equal, "audio_equal": audio_equal,
                               "audio_max_abs_diff": worst}
    return report


def soak(server: TritonServer, concurrency: int, seconds: float, workload: dict, sample_s: float = 15.0) -> dict:
    """``concurrency`` client threads streaming back to back for ``seconds``; counts every error and samples
    GPU memory (nvidia-smi, MiB per GPU: the stages may be placed on several) and the server's host RSS (server +
    stubs) over time."""
    stop_at = time.monotonic() + seconds
    counts = {"requests": 0, "errors": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(worker: int) -> None:
        index = worker
        while time.monotonic() < stop_at:
            try:
                with OmniStreamClient(server.grpc_url) as client:
                    result = client.stream(request_text(index), timeout_s=120, **dict(workload, seed=index))
                failed = result.audio_seconds == 0
            except Exception as error:  # every failure counts, whatever its kind
                failed = True
                with lock:
                    errors.append(f"{type(error).__name__}: {error}"[:300])
            with lock:
                counts["requests"] += 1
                counts["errors"] += failed
            index += concurrency

    samples = []
    started = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in range(concurrency)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        samples.append({"t_s": round(time.monotonic() - started, 1), "requests": counts["requests"],
                        "gpu_mib": gpu_memory_used_mib(),
                        "host_rss_mib": round(process_tree_rss_bytes(server.process.pid) / 2**20, 1)})
        print(f"soak {samples[-1]}", flush=True)
        for thread in threads:
            thread.join(timeout=sample_s / len(threads))
    return dict(counts, concurrency=concurrency, seconds=round(time.monotonic() - started, 1),
                first_errors=errors[:10], samples=samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint dir (default: build the tiny one)")
    parser.add_argument("--url", help="check this running server (gRPC host:port) instead of starting one")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics",
                        help="with --url: its Prometheus metrics (default: %(default)s)")
    parser.add_argument("--audio-out", type=Path, help="save every served stream's text and audio here (.npz)")
    parser.add_argument("--compare-audio", type=Path,
                        help="check every served stream against this --audio-out file of an earlier run")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="engines' dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--interstage-memory", choices=["device", "host"],
                        help="host for Python backends that cannot pass GPU tensors through decoupled BLS "
                             "(default: what the chosen backend allows)")
    parser.add_argument("--python-backend", choices=["auto", "built", "bundled"], default="auto")
    parser.add_argument("--temperature", type=float, default=0.9,
                        help="sampling temperature; request i gets seed i (default: %(default)s)")
    parser.add_argument("--compare-inprocess", action="store_true",
                        help="check every served stream against the in-process pipeline (same seed)")
    parser.add_argument("--audio-atol", type=float, default=1e-4)
    parser.add_argument("--soak-s", type=float, default=0.0, help="then soak for this many seconds")
    parser.add_argument("--soak-concurrency", type=int, default=8)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--entry", default="omni", choices=["omni", "orchestrator"])
    parser.add_argument("--fast-path", choices=["on", "off"], default="off",
                        help="the engines' Triton kernels and GPU sampling (serve --fast-path)")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="off",
                        help="CUDA-graph decode, with --fast-path on (serve --cuda-graphs)")
    add_placement_arguments(parser)  # e.g. --instances talker=2,code2wav=2: replicas on the GPU too
    parser.add_argument("--out", default="served_device_check.json")
    parser.add_argument("--log", help="tritonserver log path (default: in a temporary directory)")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=60.0,
                        help="no request finished for this long: dump every stub's Python stacks (py-spy, if "
                             "installed) and the omni_* gauges next to --out, then stop (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.url and (args.compare_inprocess or args.soak_s or args.entry != "omni"):
        parser.error("--url checks a running server's streams: --compare-inprocess, --soak-s and --entry "
                     "orchestrator need a server this check starts")
    if args.compare_audio and not args.compare_audio.is_file():
        parser.error(f"--compare-audio: no such file {args.compare_audio} (an --audio-out of an earlier run)")
    workload = dict(temperature=args.temperature, max_tokens=args.tokens, min_tokens=args.tokens,
                    ignore_eos=True, max_audio_frames=args.frames, min_audio_frames=args.frames)
    report = check_running_server(args, workload) if args.url else check_own_server(args, workload)
    served = report.pop("served")  # the streams themselves: to a file of their own, not the JSON
    if args.audio_out:
        save_streams(args.audio_out, served)
    if args.compare_audio:
        report["saved_comparison"] = {"file": str(args.compare_audio), "audio_atol": args.audio_atol,
                                      "levels": compare_saved_streams(args.compare_audio, served, args.audio_atol)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, args.device)


def measure(grpc_url: str, metrics_url: str, args, workload: dict, preprocess, watchdog) -> dict:
    """A warm-up, then each concurrency level; the host-hop counters after them."""
    run_level(grpc_url, 1, 2, workload, preprocess, watchdog)  # warm-up: first calls compile/allocate
    served: dict[int, list] = {}
    levels = [run_level(grpc_url, int(c), max(args.requests, int(c)), workload, preprocess, watchdog,
                        served.setdefault(int(c), [])) for c in args.concurrency.split(",")]
    return {"levels": levels, "interstage_host_tensors": host_hop_counters(metrics_url), "served": served}


def check_running_server(args, workload: dict) -> dict:
    def stalled():
        print(f"stalled: no request finished for {args.stall_s} s", flush=True)
        os._exit(3)

    watchdog = StallWatchdog(args.stall_s, stalled)
    try:
        measured = measure(args.url, args.metrics_url, args, workload, None, watchdog)
    finally:
        watchdog.cancel()
    return dict({"device": args.device, "gpu": gpu_name(), "server": args.url, "entry": args.entry,
                 "workload": workload}, **measured)


def check_own_server(args, workload: dict) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="omni-served-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        from omni_triton.checkpoints.tiny import build

        checkpoint = build(workdir / "tiny")
    install = find_tritonserver(python_backend=args.python_backend, device=args.device)
    config = LaunchConfig(checkpoint_dir=Path(checkpoint), device=args.device, dtype=args.dtype,
                          interstage_memory=args.interstage_memory or install.interstage_memory(args.device),
                          max_inflight_requests=64, fast_path=args.fast_path == "on",
                          cuda_graphs=args.cuda_graphs == "on", placement=placement(args))
    repository = render_repository(config, workdir / "repository")
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            gpu=args.device == "cuda", gpu_ids=config.placement.used_gpus(),
                            log_verbose=args.log_verbose)
    server = TritonServer(repository, install, options, log_path=args.log or workdir / "tritonserver.log")
    print(f"python backend: {install.python_backend_note}; interstage memory {config.interstage_memory}", flush=True)
    server.start()
    watchdog = None
    try:
        ready_s = server.wait_ready(timeout_s=600)
        watchdog = StallWatchdog(args.stall_s, lambda: dump_stuck_server(server, Path(args.out).with_suffix(".stuck")))
        preprocess = (_PreprocessedInputs(Path(checkpoint), config.kv_cache_tokens)
                      if args.entry == "orchestrator" else None)
        measured = measure(server.grpc_url, server.metrics_url, args, workload, preprocess, watchdog)
        soaked = None
        if args.soak_s:
            watchdog.progress(stall_s=args.soak_s + 300)  # the soak counts its own errors
            soaked = soak(server, args.soak_concurrency, args.soak_s, workload)
            soaked["interstage_host_tensors_after"] = host_hop_counters(server.metrics_url)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        stop_started = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - stop_started
    compared = (compare_inprocess(Path(checkpoint), config, workload, measured["served"], args.audio_atol)
                if args.compare_inprocess else None)
    return dict({"device": args.device, "gpu": gpu_name(), "python_backend": install.python_backend_note,
                 "dtype": config.resolved_dtype, "fast_path": config.fast_path,
                 "cuda_graphs": config.cuda_graphs, "interstage_memory": config.interstage_memory,
                 "entry": args.entry, "checkpoint": str(checkpoint), "ready_s": ready_s, "stop_s": stop_s,
                 "workload": workload}, **measured, inprocess_comparison=compared, soak=soaked)


def print_report(report: dict, device: str) -> None:
    if "ready_s" in report:
        print(f"ready in {report['ready_s']:.1f} s on {device}")
    print("| concurrency | TTFT p50 ms | TTFA p50 ms | TTFA max ms | RTF mean | req/s |")
    print("|---|---|---|---|---|---|")
    for level in report["levels"]:
        print(f"| {level['concurrency']} | {level['ttft_p50_ms']:.1f} | {level['ttfa_p50_ms']:.1f} | "
              f"{level['ttfa_max_ms']:.1f} | {level['rtf_mean']:.3f} | {level['requests_per_s']:.2f} |")
    print("inter-stage tensors received in host memory, by stage:", report["interstage_host_tensors"])
    if report.get("inprocess_comparison"):
        print("against the in-process pipeline (same seed):", json.dumps(report["inprocess_comparison"]))
    if "saved_comparison" in report:
        print(f"against {report['saved_comparison']['file']} (same seeds):",
              json.dumps(report["saved_comparison"]["levels"]))
    soaked = report.get("soak")
    if soaked:
        print(f"soak: {soaked['requests']} requests in {soaked['seconds']} s at {soaked['concurrency']} streams, "
              f"{soaked['errors']} errors; memory first/last: {soaked['samples'][0]} / {soaked['samples'][-1]}")
    if "stop_s" in report:
        print(f"server stopped in {report['stop_s']:.1f} s")


def gpu_name() -> str | None:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


if __name__ == "__main__":
    main()
