"""The server's limits on one realtime session (``omni-triton api --realtime-*``): light, so the CLI's help
can show the defaults without importing the endpoint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealtimeLimits:
    max_items: int = 200  # conversation items
    max_session_s: float = 3600.0
    idle_timeout_s: float = 600.0  # no client event for this long: the session ends
    max_input_audio_s: float = 120.0  # uncommitted input audio
