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
import signal
import sys
from pathlib import Path

from omni_triton.launch.memory_plan import DoesNotFit
from omni_triton.launch.mps import MpsError
from omni_triton.launch.options import LaunchOptionError
from omni_triton.launch.serve import (DEFAULT_TINY_CHECKPOINT, STAGE_RELOADED, add_launch_arguments,
                                      add_serve_arguments, start_server)
from omni_triton.launch.tritonserver import TritonServerError

DEMO_TEXT = "Hello, how are you today?"
DEMO_SEED = 0  # a seeded demo prints the same text and audio, and comparable timings, on every run
# `omni-triton build KIND` runs the main() of these build_engines modules, with the remaining arguments.
BUILDERS = {
    "tiny": "omni_triton.checkpoints.tiny",
    "dummy": "omni_triton.checkpoints.dummy",
    "onnx": "build_engines.export_code2wav_onnx",
    "trt": "build_engines.build_code2wav_trt",
    "python-backend": "build_engines.python_backend",
}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    server = start_server(args, echo_log=args.verbose)
    try:
        return server.supervise(args.ready_timeout, args.max_restarts,
                                log=lambda line: print(line, file=sys.stderr, flush=True),
                                reloaded_by_orchestrator=STAGE_RELOADED if args.allow_stage_reload else ())
    except KeyboardInterrupt:
        print(f"\nstopping tritonserver (streams in flight get {server.options.drain_s:g} s) ...", flush=True)
        return 0
    finally:
        server.stop()
        if server.drain_outcome is not None:
            print(f"streams in flight were not drained: {server.drain_outcome}", file=sys.stderr, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from omni_triton.checkpoints.tiny import is_random_weight_checkpoint
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
    from omni_triton.launch.deploy import main as deploy_main

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
    add_serve_arguments(serve)
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
