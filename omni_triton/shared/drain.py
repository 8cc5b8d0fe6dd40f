"""A stop that lets the streams in flight end first: the orchestrator's control words and the drain's bound.

Triton refuses every new request once it starts shutting down (SIGINT), BLS calls included: a session in flight
then fails at its next stage call, and its stage aborts are refused too, so the stages keep the request until
Triton's exit timeout kills them. So the launcher, before it signals tritonserver, sends the orchestrator a control
request ``CONTROL="drain"`` (request parameter ``drain_s``: how long running sessions may still run) while the
server still takes requests, and signals it once that is answered (``omni_triton.stages.orchestrator``).

Both sides of the process boundary read these: the launcher sends them, the orchestrator stub checks them.
"""

from __future__ import annotations

from omni_triton.shared.request_parameters import seconds_parameter

CONTROL_WORDS = ("cancel", "drain")
# Running sessions get this long to end on their own before the rest are cancelled: below tritonserver's exit
# timeout (ServerOptions.exit_timeout_s), which must still cover the cancelled sessions' aborts and the unloads.
DRAIN_S = 5.0
SHUTTING_DOWN = "server shutting down"


def control_word(raw: bytes) -> str:
    """The control word of a CONTROL tensor's element; ValueError naming CONTROL for any other."""
    word = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if word not in CONTROL_WORDS:
        raise ValueError(f"CONTROL must be one of {list(CONTROL_WORDS)}, got {raw!r}")
    return word


def drain_seconds(parameters: str | None) -> float:
    """The ``drain_s`` request parameter of a drain request (JSON, as ``request.parameters()`` gives it), else
    ``DRAIN_S``; ValueError naming it when it is not a number of seconds >= 0."""
    value = seconds_parameter(parameters, "drain_s", zero_allowed=True)
    return DRAIN_S if value is None else value
