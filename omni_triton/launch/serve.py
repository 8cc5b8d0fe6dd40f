"""`omni-triton serve`'s options and start: the launch settings from its flags, the rendered repository, a
started tritonserver that is ready. ``omni-triton demo`` starts the same way, and ``omni-triton deploy`` checks
its manifests against the same parser and server options."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from omni_triton.launch.first_request import send_first_requests
from omni_triton.launch.options import (add_engine_arguments, add_load_arguments, add_memory_arguments,
                                        add_model_source_arguments, add_placement_arguments, flag_settings,
                                        model_source, placement, with_kv_budget)
from omni_triton.launch.repository import render_repository
from omni_triton.launch.mps import MPS_CHOICES
from omni_triton.launch.python_backend import PYTHON_BACKEND_CHOICES
from omni_triton.launch.tritonserver import (ServerOptions, TritonInstall, TritonServer, find_tritonserver,
                                             process_tree_rss_bytes)
from omni_triton.shared.drain import DRAIN_S
from omni_triton.shared.settings import CODE2WAV_RUNTIMES, INTERSTAGE_MEMORY, STAGES, LaunchConfig
from omni_triton.warmup_progress import PROGRESS_MARK

DEFAULT_TINY_CHECKPOINT = Path("checkpoints/tiny")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything `omni-triton serve` takes: the launch arguments, and how it watches the server."""
    add_launch_arguments(parser)
    parser.add_argument("--verbose", action="store_true", help="echo the server log to stderr (default: off)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restart tritonserver after this many unexpected exits at most (default: %(default)s)")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = LaunchConfig(checkpoint_dir=Path("."))
    launch = parser.add_argument_group("model repository")
    launch.add_argument("--checkpoint", type=Path,
                        help=f"checkpoint directory (default: build the tiny one at {DEFAULT_TINY_CHECKPOINT})")
    add_model_source_arguments(launch)
    launch.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device,
                        help="where the models run (default: %(default)s)")
    launch.add_argument("--interstage-memory", choices=INTERSTAGE_MEMORY,
                        help="where tensors between stages live on a GPU: device (GPU tensors) or host; host is "
                             "for Python backends that cannot pass GPU tensors through decoupled BLS (the "
                             "nvidia-pytriton bundle's) (default: device, host with that bundled backend)")
    launch.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on cpu, bfloat16 on cuda")
    launch.add_argument("--first-chunk-frames", type=int, default=defaults.first_chunk_frames,
                        help="codec frames in a stream's first audio chunk: few, for an early first audio "
                             "(12.5 frames per second; default: %(default)s)")
    launch.add_argument("--next-chunk-frames", type=int, default=defaults.next_chunk_frames,
                        help="most codec frames in a later audio chunk; chunks ramp up to it, each at most twice the "
                             "audio already out (default: %(default)s)")
    add_memory_arguments(launch)
    add_placement_arguments(launch)
    launch.add_argument("--max-batched-tokens", type=int, default=defaults.max_batched_tokens,
                        help="tokens per engine step, decode + chunked prefill (default: %(default)s)")
    add_engine_arguments(launch)
    launch.add_argument("--warmup", choices=["on", "off"],
                        help="warm start: before reporting ready, each stage runs every kernel shape and captures "
                             "every CUDA graph that serving up to --max-inflight streams uses (a progress line per "
                             "stage; default: on with --device cuda, off on cpu)")
    launch.add_argument("--max-inflight", type=int, default=defaults.max_inflight_requests,
                        help="concurrent requests per stage (default: %(default)s)")
    add_load_arguments(launch)
    launch.add_argument("--max-tokens-cap", type=int, default=defaults.max_tokens_cap,
                        help="largest MAX_TOKENS a request may ask for (default: %(default)s)")
    launch.add_argument("--max-text-chars", type=int, default=defaults.max_text_chars,
                        help="longest TEXT a request may send, in characters (default: %(default)s)")
    launch.add_argument("--max-audio-seconds", type=float, default=defaults.max_audio_seconds,
                        help="longest AUDIO_IN a request may send, in seconds (default: %(default)s)")
    launch.add_argument("--torch-threads", type=int, default=1, help="torch threads per stage (default: 1)")
    launch.add_argument("--code2wav-runtime", choices=CODE2WAV_RUNTIMES, default=defaults.code2wav_runtime,
                        help="the vocoder's runtime: torch, onnx (ONNX Runtime), trt (TensorRT) or auto (the engine "
                             "file's kind) (default: %(default)s)")
    launch.add_argument("--code2wav-engine", type=Path,
                        help="the .onnx / .plan file for --code2wav-runtime onnx|trt|auto (default: none)")
    launch.add_argument("--models", help="comma-separated subset of models to serve (default: all)")
    launch.add_argument("--run-dir", type=Path, default=Path("build/run"),
                        help="where the rendered repository and server log go (default: %(default)s)")
    server = parser.add_argument_group("tritonserver")
    server.add_argument("--tritonserver", help="tritonserver binary (default: $TRITONSERVER, "
                                               "/opt/tritonserver, then the nvidia-pytriton bundle)")
    server.add_argument("--python-backend", choices=PYTHON_BACKEND_CHOICES,
                        default=os.environ.get("OMNI_TRITON_PYTHON_BACKEND", "auto"),
                        help="built: the Python backend built by `omni-triton build python-backend`; bundled: the "
                             "tritonserver install's own; auto: built when present (default: %(default)s)")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    server.add_argument("--http-port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    server.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default: %(default)s)")
    server.add_argument("--metrics-port", type=int, default=8002,
                        help="Prometheus metrics port (default: %(default)s)")
    server.add_argument("--allow-stage-reload", action="store_true",
                        help="model-control-mode explicit, so that a stage whose stub process died is reloaded "
                             "alone, tritonserver kept: a thinker, talker or code2wav by the orchestrator, the "
                             "orchestrator (all its instances) by serve itself (the repository load/unload API is "
                             "then open to clients too; default: off)")
    server.add_argument("--mps", choices=MPS_CHOICES, default="auto",
                        help="CUDA MPS for the stages sharing a GPU (--device cuda): auto uses the host's control "
                             "daemon when it sees this server's GPUs (CUDA_VISIBLE_DEVICES), else starts one of its "
                             "own on them when nvidia-cuda-mps-control is installed, else goes without; on insists; "
                             "off never (default: %(default)s)")
    server.add_argument("--cuda-memory-pool-mb", type=_pool_mb, default=ServerOptions.cuda_memory_pool_bytes >> 20,
                        help="cuda: tritonserver's CUDA memory pool per GPU, MiB: GPU tensors between the stages cross "
                             "processes through it, and a tensor that finds it full gets a cudaMalloc and an IPC "
                             "open and close of its own, silently; it comes out of the memory the KV plan leaves "
                             "(default: %(default)s)")
    server.add_argument("--drain-seconds", type=_drain_seconds, default=DRAIN_S,
                        help="on stop (Ctrl-C, SIGTERM), streams in flight may run this long before they are ended with "
                             "UNAVAILABLE 'server shutting down'; new requests are refused meanwhile; keep it below "
                             "tritonserver's 10 s exit timeout (default: %(default)s)")
    server.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds; warm start (--warmup) is part of it (default: %(default)s)")


def _pool_mb(text: str) -> int:
    """--cuda-memory-pool-mb: a whole number of MiB, at least 1."""
    try:
        mib = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of MiB, got {text!r}") from None
    if mib < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 MiB, got {text}")
    return mib


def _drain_seconds(text: str) -> float:
    """--drain-seconds: below tritonserver's exit timeout, which the aborts and unloads after the drain need too."""
    exit_timeout_s = ServerOptions.exit_timeout_s
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= seconds < exit_timeout_s:
        raise argparse.ArgumentTypeError(f"must be in [0, {exit_timeout_s}) (tritonserver's exit timeout), got {text}")
    return seconds


def _tiny_checkpoint() -> Path:
    from omni_triton.checkpoints.tiny import build

    return build(DEFAULT_TINY_CHECKPOINT)


def launch_config(args: argparse.Namespace, install: TritonInstall) -> tuple[LaunchConfig, str]:
    """The launch config and a note saying the KV budget (on cuda: how it fits the GPU)."""
    source = model_source(args, _tiny_checkpoint)
    config = LaunchConfig(**{
        **flag_settings(args),
        # settings whose flag differs from the field: a name, a type, or a default only the launcher knows
        "checkpoint_dir": source.checkpoint_dir, "load_format": source.load_format, "dummy_seed": source.seed,
        "interstage_memory": args.interstage_memory or install.interstage_memory(args.device),
        "max_inflight_requests": args.max_inflight, "code2wav_engine_path": args.code2wav_engine,
        "torch_threads": {stage: args.torch_threads for stage in STAGES}, "placement": placement(args),
    })
    return with_kv_budget(config, args.kv_cache_tokens, args.gpu_memory_utilization)


def server_options(args: argparse.Namespace, config: LaunchConfig) -> ServerOptions:
    """The tritonserver options of ``serve`` (``deploy render`` checks its manifests against them)."""
    return ServerOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                         metrics_port=args.metrics_port, gpu=config.device == "cuda",
                         gpu_ids=config.placement.used_gpus(), stage_reload=args.allow_stage_reload, mps=args.mps,
                         drain_s=args.drain_seconds, cuda_memory_pool_bytes=args.cuda_memory_pool_mb << 20)


def start_server(args: argparse.Namespace, echo_log: bool) -> TritonServer:
    install = find_tritonserver(args.tritonserver, args.python_backend, args.device)
    config, kv_note = launch_config(args, install)
    models = args.models.split(",") if args.models else None
    repository = render_repository(config, args.run_dir / "repository", models)
    server = TritonServer(repository, install, server_options(args, config),
                          log_path=args.run_dir / "tritonserver.log", echo_log=echo_log,
                          echo_lines_with=PROGRESS_MARK)
    print(f"tritonserver ({install.origin}: {install.binary})\n"
          f"  python backend: {install.python_backend_note}\n"
          f"  checkpoint {config.checkpoint_dir}"
          + (f" (random weights: --load-format dummy, seed {config.dummy_seed})" if config.load_format == "dummy"
             else "")
          + f", device {config.device} {config.resolved_dtype}, interstage memory {config.interstage_memory}, "
          f"repository {repository}\n  placement: {config.placement.describe(config.device)}\n  {kv_note}", flush=True)
    server.start()
    print(f"  CUDA MPS: {server.mps.note}", flush=True)
    try:
        waited = server.wait_ready(timeout_s=args.ready_timeout)
        if config.resolved_warmup and models is None:  # the whole pipeline is served: one request through it
            first_s = send_first_requests(server.grpc_url, count=config.placement.orchestrator_instances)
            print(f"  first request through {config.placement.pipelines} pipeline(s): {first_s:.1f} s", flush=True)
    except BaseException:
        server.stop()
        raise
    rss = process_tree_rss_bytes(server.process.pid) / 2**20
    print(f"ready in {waited:.1f} s (server + stubs RSS {rss:.0f} MiB): grpc {server.grpc_url}, "
          f"http {server.http_url}, metrics {server.metrics_url}", flush=True)
    return server


# stages the orchestrator reloads itself when their stub dies (with --allow-stage-reload)
STAGE_RELOADED = ("thinker", "talker", "code2wav")
