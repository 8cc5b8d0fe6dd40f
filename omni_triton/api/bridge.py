"""The gRPC stream to Triton, on asyncio (``triton_stream``): one stream per request, many at once on
one event loop.

A request that ends early (the HTTP client went away, or the handler failed) is cancelled on the server: its
gRPC stream is cancelled, which ends what Triton has not scheduled yet, and the orchestrator gets a control
``cancel`` with the request's id, which ends a request already inside it (Triton does not pass an ensemble's
cancellation to a running step; ``omni_triton.client.OmniStreamClient.cancel`` does the same, synchronously).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np

from omni_triton.api.errors import TritonRequestError
from omni_triton.api.triton_stream import StreamChannel, infer_request, is_final
from omni_triton.client import GRPC_ERROR_HEADERS, error_code, text_delta

logger = logging.getLogger("omni_triton.api")
CANCEL_TIMEOUT_S = 10.0


@dataclass
class Piece:
    """One response of the stream: a text delta and/or 24 kHz float audio."""

    text: str
    audio: np.ndarray | None


class TritonBridge:
    def __init__(self, url: str, model: str = "omni"):
        self.url, self.model = url, model
        self.streams = StreamChannel(url)  # requests and health (triton_stream says why not tritonclient's aio)
        self._cancels: set[asyncio.Task] = set()  # cancels under way: keep them referenced until done
        # the latest request ids whose cancel the orchestrator accepted (what a log reader or a test checks)
        self.cancelled: deque[str] = deque(maxlen=256)

    async def ready(self) -> bool:
        try:
            return await self.streams.ready(self.model)
        except grpc.RpcError:
            return False

    async def stream(self, arrays: dict[str, np.ndarray], request_id: str) -> AsyncIterator[Piece]:
        """The request's responses as they arrive; raises TritonRequestError for a failed request."""
        responses = self.streams.open(infer_request(self.model, arrays, request_id), GRPC_ERROR_HEADERS)
        complete = False
        try:
            async for result, error in responses:
                if error is not None:
                    complete = True  # the server ended the request with this error
                    raise TritonRequestError(error_code(error), error.message())
                piece = _piece(result)
                if piece.text or piece.audio is not None:
                    yield piece
                if is_final(result):
                    complete = True
                    return
            complete = True
            raise TritonRequestError("UNAVAILABLE", "the stream ended before the request's final response")
        except grpc.RpcError as error:  # the stream itself broke: the server is down, refused, ...
            complete = True
            raise TritonRequestError(error.code().name, error.details() or str(error)) from None
        finally:
            if complete:
                responses.close()
            else:
                responses.cancel()
                self._cancel_in_background(request_id)

    def _cancel_in_background(self, request_id: str) -> None:
        # Runs on its own task: the stream's task is itself being cancelled when the HTTP client went away.
        task = asyncio.get_running_loop().create_task(self.cancel(request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def cancel(self, request_id: str) -> None:
        """Send the orchestrator a control ``cancel`` for ``request_id`` (a stream of its own)."""
        control = {"CONTROL": np.array([b"cancel"], dtype=np.object_)}
        responses = self.streams.open(infer_request("orchestrator", control, request_id))
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                async for result, error in responses:
                    if error is not None:
                        logger.warning("cancel of %s failed: %s", request_id, error)
                        return
                    if is_final(result):
                        self.cancelled.append(request_id)
                        logger.info("request %s cancelled: its client went away", request_id)
                        return
        except (TimeoutError, grpc.RpcError) as error:
            logger.warning("cancel of %s not answered: %s", request_id, error)
        finally:
            responses.cancel()

    async def close(self) -> None:
        if self._cancels:
            await asyncio.wait(self._cancels, timeout=CANCEL_TIMEOUT_S)
        await self.streams.close()


def _piece(result) -> Piece:
    audio = result.as_numpy("AUDIO")
    return Piece(text_delta(result), audio.reshape(-1).astype(np.float32) if audio is not None and audio.size else None)
