"""``omni-triton api``: the OpenAI-compatible HTTP server (uvicorn, one process, one event loop)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001",
                        help="the running tritonserver's gRPC address (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--model", default="omni",
                        help="the Triton model to serve, also the name clients pass as `model` (default: %(default)s)")
    parser.add_argument("--checkpoint", type=Path,
                        help="the served checkpoint's directory: its tokenizer counts tokens for `usage` "
                             "(default: none; usage then has audio tokens only)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="uvicorn's log level (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from omni_triton.api.app import create_app

    app = create_app(args.triton_grpc, args.model, args.checkpoint)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
