"""Triton error codes carried in the error message itself, as "[CODE] message".

Why: a streamed error reaches a gRPC client as a message only. The ``triton_grpc_error`` stream header makes
the server end the stream with the error's gRPC status instead, but tritonserver 2.51 (the nvidia-pytriton
bundle) segfaults in its gRPC frontend (``ModelStreamInferHandler::Process``) within a few dozen streams ended
that way. So the pipeline's own errors name their code in the message, and the client reads it from there.
"""

from __future__ import annotations

import re

CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL", "NOT_FOUND", "UNSUPPORTED", "ALREADY_EXISTS")
_TAG = re.compile(r"\[(" + "|".join(CODES) + r")\] ")


def tagged(code: str, message: str) -> str:
    """``message`` with its Triton error code in front (``code`` one of CODES)."""
    if code not in CODES:
        raise ValueError(f"unknown Triton error code {code!r}")
    return f"[{code}] {message}"


def code_of(message: str) -> str | None:
    """The code a tagged message names (anywhere in it: Triton prefixes an ensemble's name), or None."""
    match = _TAG.search(message)
    return match.group(1) if match else None


def triton_error(pb, code: str, message: str):
    """A ``pb_utils.TritonError`` with ``code`` set and named in its message."""
    return pb.TritonError(tagged(code, message), getattr(pb.TritonError, code))
