"""omni-triton: serve the Qwen3-Omni pipeline on tritonserver, run a demo request, build checkpoints/engines.

    omni-triton serve [--checkpoint DIR | --config NAME] [--device cpu|cuda] [--tritonserver PATH] ...
    omni-triton serve --device cuda --config qwen3_omni_30b_a3b   full size, seeded random bf16 weights
    omni-triton demo  ["text"] [--out out.wav]      start a server, stream one request, stop
    omni-triton build tiny|onnx|trt|python-backend [builder options]
    omni-triton deploy deploy/values/*.yaml         Kubernetes manifests (deploy/k8s/<values name>/)
    omni-triton api   [--triton-grpc HOST:8001] [--port 9000]   OpenAI-compatible HTTP API (docs/openai_api.md)
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path

from omni_triton.server.memory_plan import DoesNotFit
from omni_triton.server.launch_options import (LaunchOptionError, add_engine_arguments, add_load_arguments,
                                               add_memory_arguments, add_model_source_arguments,
                                               add_placement_arguments, model_source, placement, with_kv_budget)
from omni_triton.server.repository import (CODE2WAV_RUNTIMES, INTERSTAGE_MEMORY, STAGES, LaunchConfig,
                                          render_repository)
from omni_triton.server.mps import MPS_CHOICES, MpsError
from omni_triton.server.python_backend import PYTHON_BACKEND_CHOICES
from omni_triton.server.tritonserver import (ServerOptions, TritonInstall, TritonServer, TritonServerError,
                                             find_tritonserver, process_tree_rss_bytes)
from omni_triton.warmup_progress import PROGRESS_MARK

DEFAULT_TINY_CHECKPOINT = Path("checkpoints/tiny")
DEMO_TEXT = "Hello, how are you today?"
DEMO_SEED = 0  # a seeded demo prints the same text and audio, and comparable timings, on every run
# `omni-triton build KIND` runs the main() of these build_engines modules, with the remaining arguments.
BUILDERS = {
    "tiny": "build_engines.tiny_checkpoint",
    "dummy": "build_engines.dummy_checkpoint",
    "onnx": "build_engines.export_code2wav_onnx",
    "trt": "build_engines.build_code2wav_trt",
    "python-backend": "build_engines.python_backend",
}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = LaunchConfig(checkpoint_dir=Path("."))
    launch = parser.add_argument_group("model repository")
    launch.add_argument("--checkpoint", type=Path,
                        help=f"checkpoint directory (default: build the tiny one at {DEFAULT_TINY_CHECKPOINT})")
    add_model_source_arguments(launch)
    launch.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
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
    launch.add_argument("--code2wav-runtime", choices=CODE2WAV_RUNTIMES, default="torch",
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
                             "(the repository load/unload API is then open to clients too; default: off)")
    server.add_argument("--mps", choices=MPS_CHOICES, default="auto",
                        help="CUDA MPS for the stages sharing a GPU (--device cuda): auto uses the host's control "
                             "daemon when it sees this server's GPUs (CUDA_VISIBLE_DEVICES), else starts one of its "
                             "own on them when nvidia-cuda-mps-control is installed, else goes without; on insists; "
                             "off never (default: %(default)s)")
    server.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds; warm start (--warmup) is part of it (default: %(default)s)")


def _tiny_checkpoint() -> Path:
    from build_engines.tiny_checkpoint import build

    return build(DEFAULT_TINY_CHECKPOINT)


def launch_config(args: argparse.Namespace, install: TritonInstall) -> tuple[LaunchConfig, str]:
    """The launch config and a note saying the KV budget (on cuda: how it fits the GPU)."""
    source = model_source(args, _tiny_checkpoint)
    config = LaunchConfig(
        checkpoint_dir=source.checkpoint_dir, device=args.device, dtype=args.dtype,
        load_format=source.load_format, dummy_seed=source.seed, quantization=source.quantization,
        interstage_memory=args.interstage_memory or install.interstage_memory(args.device),
        first_chunk_frames=args.first_chunk_frames, next_chunk_frames=args.next_chunk_frames,
        left_context_frames=args.left_context_frames, max_batched_tokens=args.max_batched_tokens,
        fast_path=args.fast_path == "on", cuda_graphs=args.cuda_graphs == "on",
        prefill_graphs=args.prefill_graphs == "on", linear_launch=args.linear_launch,
        dependent_launch=args.dependent_launch == "on", overlap_steps=args.overlap_steps == "on",
        max_inflight_requests=args.max_inflight, max_tokens_cap=args.max_tokens_cap,
        chunk_pacing=args.chunk_pacing, admission_queue=args.admission_queue,
        admission_capacity=args.admission_capacity, admission_max_starting=args.admission_max_starting,
        max_text_chars=args.max_text_chars, max_audio_seconds=args.max_audio_seconds,
        torch_threads={stage: args.torch_threads for stage in STAGES},
        code2wav_runtime=args.code2wav_runtime, code2wav_engine_path=args.code2wav_engine,
        code2wav_max_batch=args.code2wav_max_batch, placement=placement(args),
        warmup=None if args.warmup is None else args.warmup == "on",
    )
    return with_kv_budget(config, args.kv_cache_tokens, args.gpu_memory_utilization)


def server_options(args: argparse.Namespace, config: LaunchConfig) -> ServerOptions:
    """The tritonserver options of ``serve`` (``deploy render`` checks its manifests against them)."""
    return ServerOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                         metrics_port=args.metrics_port, gpu=config.device == "cuda",
                         gpu_ids=config.placement.used_gpus(), stage_reload=args.allow_stage_reload, mps=args.mps)


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
    except BaseException:
        server.stop()
        raise
    rss = process_tree_rss_bytes(server.process.pid) / 2**20
    print(f"ready in {waited:.1f} s (server + stubs RSS {rss:.0f} MiB): grpc {server.grpc_url}, "
          f"http {server.http_url}, metrics {server.metrics_url}", flush=True)
    return server


# stages the orchestrator reloads itself when their stub dies (with --allow-stage-reload)
STAGE_RELOADED = ("thinker", "talker", "code2wav")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    server = start_server(args, echo_log=args.verbose)
    try:
        return server.supervise(args.ready_timeout, args.max_restarts,
                                log=lambda line: print(line, file=sys.stderr, flush=True),
                                reloaded_by_orchestrator=STAGE_RELOADED if args.allow_stage_reload else ())
    except KeyboardInterrupt:
        print("\nstopping tritonserver ...", flush=True)
        return 0
    finally:
        server.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from build_engines.tiny_checkpoint import is_random_weight_checkpoint
    from omni_triton.client import machine_description, run_request

    server = start_server(args, echo_log=False)
    try:
        if args.config or args.load_format == "dummy" or is_random_weight_checkpoint(
                args.checkpoint or DEFAULT_TINY_CHECKPOINT):
            print("random-weight checkpoint: text and audio are noise; see README", flush=True)
        run_request(server.grpc_url, args.text, args, args.out)
        print(f"machine: {machine_description()}; models on {args.device}; seed {args.seed}")
    finally:
        server.stop()
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    module_name = BUILDERS[args.kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(f"omni-triton build {args.kind}: {module_name} is not available in this checkout", file=sys.stderr)
        return 2
    module.main(args.builder_args)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from omni_triton.deploy import main as deploy_main

    return deploy_main(args.deploy_args)


def cmd_bench(args: argparse.Namespace) -> int:
    from omni_triton.bench.cli import main as bench_main

    return bench_main(args.bench_args)


def cmd_api(args: argparse.Namespace) -> int:
    from omni_triton.api.server import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-triton", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="render the model repository and run tritonserver until Ctrl-C")
    add_launch_arguments(serve)
    serve.add_argument("--verbose", action="store_true", help="echo the server log to stderr (default: off)")
    serve.add_argument("--max-restarts", type=int, default=5,
                       help="restart tritonserver after this many unexpected exits at most (default: %(default)s)")
    serve.set_defaults(handler=cmd_serve)

    from omni_triton.client import add_request_arguments

    demo = commands.add_parser("demo", help="start a server, stream one request, write a WAV, print TTFA, stop")
    demo.add_argument("text", nargs="?", default=DEMO_TEXT, help="user text (default: %(default)r)")
    demo.add_argument("--out", type=Path, default=Path("out.wav"), help="WAV to write (default: %(default)s)")
    add_request_arguments(demo, seed_default=DEMO_SEED)
    add_launch_arguments(demo)
    demo.set_defaults(handler=cmd_demo)

    build = commands.add_parser("build", help="build a tiny checkpoint, the Code2Wav ONNX model or TRT engine")
    build.add_argument("kind", choices=sorted(BUILDERS), help="what to build; options after it go to the builder")
    build.add_argument("builder_args", nargs=argparse.REMAINDER, help="options for the builder (see KIND --help)")
    build.set_defaults(handler=cmd_build)

    deploy = commands.add_parser("deploy", add_help=False,
                                 help="Kubernetes manifests for deploy/values/*.yaml (see deploy --help)")
    deploy.add_argument("deploy_args", nargs=argparse.REMAINDER, help="values files and --out DIR")
    deploy.set_defaults(handler=cmd_deploy)

    from omni_triton.api.server import add_api_arguments

    api = commands.add_parser("api", help="OpenAI-compatible HTTP API (chat completions with audio, speech) in "
                                          "front of a running tritonserver")
    add_api_arguments(api)
    api.set_defaults(handler=cmd_api)

    bench = commands.add_parser("bench", add_help=False,
                                help="TTFA/RTF/throughput sweep against baselines (see bench --help)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options for the benchmark")
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own parser (and --help): hand it everything after "bench"
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    if argv[:1] == ["deploy"]:  # likewise
        return cmd_deploy(argparse.Namespace(deploy_args=argv[1:]))
    args = build_parser().parse_args(argv)
    from tritonclient.utils import InferenceServerException

    # Ctrl-C, kill -INT (even from a shell that started us with SIGINT ignored) and SIGTERM (docker stop) all
    # unwind through KeyboardInterrupt, so a started tritonserver is always stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except (TritonServerError, InferenceServerException, LaunchOptionError, DoesNotFit, MpsError) as error:
        print(f"omni-triton: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
