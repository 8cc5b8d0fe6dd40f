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
    max_output_audio_s: float | None = None  # a reply's audio (None: until the talker stops)

    def max_output_audio_frames(self) -> int | None:
        """``max_output_audio_s`` in codec frames (12.5 a second: 1920 samples at 24 kHz each), at least one."""
        return None if self.max_output_audio_s is None else max(1, round(self.max_output_audio_s * 12.5))
