"""Triton request parameters the stages read (``request.parameters()``: a JSON object), checked where they are read.

Both sides of the process boundary use these: clients and the launcher set them, the orchestrator stub reads them.
"""

from __future__ import annotations

import json
import math


def seconds_parameter(parameters: str | None, name: str, *, zero_allowed: bool) -> float | None:
    """Parameter ``name`` of a request's JSON ``parameters`` as seconds (None when absent); ValueError naming it
    when it is not a finite number above 0 (or at least 0 with ``zero_allowed``)."""
    value = json.loads(parameters or "{}").get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (value == 0 and not zero_allowed):
        kind = "a number of seconds >= 0" if zero_allowed else "a positive number of seconds"
        raise ValueError(f"parameter {name} must be {kind}, got {value!r}")
    return float(value)
