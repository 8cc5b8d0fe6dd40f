"""Responses sent once the GPU work that writes them is done, from a thread of their own.

A stage that answers every request of a batch at the end of ``execute`` waits there for its GPU work, and
Triton hands it the next batch only after that: the GPU idles while the host exports and sends, and the host
idles while the GPU decodes. A decoupled stage instead queues its GPU work, records an event after it and
leaves the responses to this thread, which exports them on a stream that waits for that event alone
(``engine.handoff.OutputStream``) while ``execute`` already takes the next batch.

A final flag with no response (the talker acknowledging a thinker chunk it took) goes the same way: a send waits
until Triton's parent process has taken it, then for the GIL, and on the execute thread that wait held up every
request queued behind it (a third of the talker's execute at 64 streams on the H200).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from omni_triton.engine.handoff import OutputStream

logger = logging.getLogger(__name__)


@dataclass
class PendingResponse:
    sender: Any  # the request's response sender
    # -> the InferenceResponse (exports its tensors: runs on the sending thread), or None: the final flag alone
    # (so does a PendingResponse without ``make``)
    make: Callable[[], Any] | None = None


class DeferredSends:
    def __init__(self, pb_utils: Any, device: torch.device):
        self._pb = pb_utils
        self._output_stream = OutputStream(device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="deferred-sends", daemon=True)
        self._device = device
        self._thread.start()

    def send_after(self, event: torch.cuda.Event | None, tensors: list[torch.Tensor],
                   responses: list[PendingResponse],
                   on_sent: Callable[[float, float], None] | None = None) -> None:
        """Send ``responses`` (each the final one of its request) once ``event``'s work is done; ``tensors``
        are the device tensors they export (made on the caller's stream). ``on_sent(started, ended)``: called
        once they are out, with the monotonic times this thread took them up and finished (the call log)."""
        self._queue.put((event, tensors, responses, on_sent))

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, tensors, responses, on_sent = item
            started = time.monotonic()
            with self._output_stream.handling([event], tensors):
                for pending in responses:
                    self._send(pending)
            if on_sent is not None:
                try:
                    on_sent(started, time.monotonic())
                except Exception:  # a trace record must never stop the responses that follow
                    logger.exception("recording a send failed")

    def _send(self, pending: PendingResponse) -> None:
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            response = pending.make() if pending.make is not None else None
        except Exception as error:  # the request must still get its final response
            logger.exception("building a response failed")
            response = self._pb.InferenceResponse(
                error=self._pb.TritonError(f"{type(error).__name__}: {error}"))
        try:
            if response is None:
                pending.sender.send(flags=final)
            else:
                pending.sender.send(response, flags=final)
        except Exception:  # the caller is gone (cancelled): nothing left to tell it
            logger.info("response not delivered", exc_info=True)
