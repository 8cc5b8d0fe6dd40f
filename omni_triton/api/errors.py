"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.

A Triton error is translated by its code (``omni_triton.client.error_code``): INVALID_ARG is the client's
fault (400, naming the request field that maps to the Triton input it names), UNAVAILABLE is 503, anything
unexpected is 500 with a request id to grep the log for, never the server's internals.
"""

from __future__ import annotations

import logging
import re
from typing import Mapping

logger = logging.getLogger("omni_triton.api")

# Triton error code -> (HTTP status, OpenAI error type)
TRITON_STATUS = {
    "INVALID_ARG": (400, "invalid_request_error"),
    "UNSUPPORTED": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "CANCELLED": (499, "cancelled"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming ``param`` (the request field, dotted: ``audio.voice``, ``messages[0].content``)."""
    return ApiError(400, f"{param} {message}", param=param, code="invalid_value")


class TritonRequestError(Exception):
    """A request Triton failed (or the stream to it broke): ``code`` is a Triton error code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def from_triton(error: TritonRequestError, params_of_inputs: Mapping[str, str], request_id: str) -> ApiError:
    """The ApiError a client sees for a failed Triton request; ``params_of_inputs`` maps the Triton input names
    an INVALID_ARG message may start with (``SPEAKER must be one of ...``) to the request field that set it."""
    status, kind = TRITON_STATUS.get(error.code, (500, "server_error"))
    if status == 500:
        logger.error("request %s: Triton failed with %s", request_id, error)
        return ApiError(500, f"internal server error (request {request_id})", type=kind, code="internal_error")
    if error.code == "INVALID_ARG":
        message = _untagged(error.message)
        field = message.split(" ", 1)[0]
        param = params_of_inputs.get(field)
        if param is not None:
            message = param + message[len(field):]
        return ApiError(status, message, param=param, type=kind, code="invalid_value")
    logger.warning("request %s: Triton answered %s", request_id, error)
    return ApiError(status, f"the model server answered {error.code}: {_untagged(error.message)}", type=kind,
                    code=error.code.lower())


def _untagged(message: str) -> str:
    """The message without Triton's ensemble prefix and the ``[CODE]`` tag (``omni_triton.error_tags``)."""
    return re.sub(r"^.*?\[[A-Z_]+\] ", "", message, count=1, flags=re.S)
