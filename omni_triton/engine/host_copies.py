"""Copies between pinned host buffers and the device that the host does not wait for at once.

A non-blocking copy reads (host -> device) or writes (device -> host) its pinned buffer when the stream gets
there, not when it is queued. A synchronous step never noticed: it waited for its sampled ids, behind every
copy it had queued, before touching a buffer again. Overlapped steps (``overlap.py``) queue the next step
while the last one runs, so a buffer is rewritten only once its last copy is known done (``StagingGuard``),
and sampled ids come back through buffers of their own, read after their copy's event (``HostIds``).
"""

from __future__ import annotations

import torch


class StagingGuard:
    """Guards a pinned buffer that host -> device copies read: ``before_write`` waits for the copies queued
    after the last ``copies_queued`` (at once when the stream is past them, as it is in a synchronous step)."""

    def __init__(self, device: torch.device):
        self._event = torch.cuda.Event() if torch.device(device).type == "cuda" else None
        self._queued = False

    def before_write(self) -> None:
        if self._queued:
            self._event.synchronize()
            self._queued = False

    def copies_queued(self) -> None:
        if self._event is not None:
            self._event.record()
            self._queued = True


class HostIds:
    """Sampled ids' device -> host copy, started at launch and read at finish. With a pinned ``host`` buffer
    (CUDA): a non-blocking copy and an event to wait on; else (CPU) the ids themselves."""

    def __init__(self, ids: torch.Tensor | None, host: torch.Tensor | None = None):
        self._ids = ids
        self._event = None
        if ids is not None and host is not None:
            self._ids = host[:ids.shape[0]]
            self._ids.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def tolist(self) -> list[int]:
        if self._ids is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._ids.tolist()
