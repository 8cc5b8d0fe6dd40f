"""``omni-triton api``: the OpenAI-compatible HTTP server (uvicorn, one process, one event loop)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omni_triton.api.realtime.limits import RealtimeLimits


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
    defaults = RealtimeLimits()
    realtime = parser.add_argument_group("realtime sessions (/v1/realtime)")
    realtime.add_argument("--realtime-max-items", type=int, default=defaults.max_items,
                          help="conversation items a session holds at most (default: %(default)s)")
    realtime.add_argument("--realtime-max-session-s", type=float, default=defaults.max_session_s,
                          help="seconds a session lives at most (default: %(default)s)")
    realtime.add_argument("--realtime-idle-timeout-s", type=float, default=defaults.idle_timeout_s,
                          help="a session without a client event for this long ends (default: %(default)s)")
    realtime.add_argument("--realtime-max-input-audio-s", type=float, default=defaults.max_input_audio_s,
                          help="uncommitted input audio a session buffers at most, seconds (default: %(default)s)")
    realtime.add_argument("--realtime-max-output-audio-s", type=float, default=defaults.max_output_audio_s,
                          help="seconds of audio a reply speaks at most, e.g. to bound the replies of random "
                               "weights, whose talker never stops (default: none: until the talker stops)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from omni_triton.api.app import create_app

    limits = RealtimeLimits(max_items=args.realtime_max_items, max_session_s=args.realtime_max_session_s,
                            idle_timeout_s=args.realtime_idle_timeout_s,
                            max_input_audio_s=args.realtime_max_input_audio_s,
                            max_output_audio_s=args.realtime_max_output_audio_s)
    app = create_app(args.triton_grpc, args.model, args.checkpoint, limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
