"""The HTTP routes: OpenAI's chat completions (text + audio out, streamed or not), speech, and the Realtime
WebSocket (``omni_triton.api.realtime``) with its voice demo page, over one ``TritonBridge`` (many concurrent
gRPC streams on one event loop).

A request's first Triton response is awaited before the HTTP answer starts, so a request the model refuses
(INVALID_ARG from its preprocess stage) gets a 400 naming the field, not a 200 stream that fails. After that,
pieces go out as they arrive: nothing is buffered on the way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import numpy as np
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from omni_triton.api.bridge import Piece, TritonBridge
from omni_triton.api.encoding import pcm16_bytes, sse, streamed_wav_header, wav_bytes
from omni_triton.api.errors import ApiError, TritonRequestError, from_triton, logger
from omni_triton.api.prompt import OmniRequest, chat_request, speech_request
from omni_triton.api.realtime.connection import RealtimeConnection
from omni_triton.api.realtime.events import error_event
from omni_triton.api.realtime.limits import RealtimeLimits
from omni_triton.api.schema import ChatCompletionRequest, SpeechRequest, validation_error
from omni_triton.api.usage import TokenCounter, Usage

SPEECH_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


class ClientGone(Exception):
    """The HTTP client disconnected before a non-streamed answer was ready."""


DEMO_PAGE = Path(__file__).parent / "realtime" / "demo.html"


def create_app(triton_grpc: str, model: str = "omni", checkpoint_dir: str | Path | None = None,
               realtime_limits: RealtimeLimits = RealtimeLimits()) -> FastAPI:
    """``model``: the Triton model served, and the name clients pass as ``model``. ``checkpoint_dir``: where the
    tokenizer for ``usage``'s token counts is (absent: those counts are null)."""
    counter = TokenCounter(checkpoint_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.bridge = TritonBridge(triton_grpc, model)  # its gRPC channel belongs to this event loop
        try:
            yield
        finally:
            await app.state.bridge.close()

    app = FastAPI(title="omni-triton OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone) -> JSONResponse:
        return JSONResponse(ApiError(499, "client disconnected", type="cancelled").body(), status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(ApiError(500, "internal server error", type="server_error", code="internal_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if await request.app.state.bridge.ready():
            return JSONResponse({"status": "ready"})
        error = ApiError(503, f"the model server at {triton_grpc} or its model {model!r} is not ready",
                         type="service_unavailable", code="unavailable")
        return JSONResponse(error.body(), status_code=503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "omni-triton"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, omni, completion_id, pieces = await _begin(request, model, ChatCompletionRequest, chat_request,
                                                         "chatcmpl")
        answer = ChatAnswer(completion_id, model, body, omni, counter)
        if body.stream:
            return StreamingResponse(answer.events(pieces), media_type="text/event-stream")
        return await _unless_disconnected(request, answer.whole(pieces))

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        body, omni, _, pieces = await _begin(request, model, SpeechRequest, speech_request, "speech")
        answer = SpeechAnswer(pieces, body.response_format)
        if body.stream_format == "sse":
            return StreamingResponse(answer.events(omni, counter), media_type="text/event-stream")
        return StreamingResponse(answer.audio(), media_type=SPEECH_MEDIA_TYPES[body.response_format])

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        requested = websocket.query_params.get("model", model)
        if requested != model:
            await websocket.accept()
            error = ApiError(404, f"model {requested!r} does not exist; this server serves {model!r}",
                             param="model", code="model_not_found")
            await websocket.send_json(error_event(error))
            await websocket.close(code=1008)
            return
        await RealtimeConnection(websocket, websocket.app.state.bridge, counter, model, realtime_limits).run()

    @app.get("/demo")
    async def demo() -> HTMLResponse:
        return HTMLResponse(DEMO_PAGE.read_text())

    return app


async def _begin(request: Request, served_model: str, schema: type[BaseModel], to_omni: Callable,
                 id_prefix: str) -> tuple[Any, OmniRequest, str, AsyncIterator[Piece]]:
    """Parse and check the body, and start its Triton request: (body, its omni request, the request id, the
    pieces, the first already received)."""
    body = await _parse(request, schema)
    _check_model(body.model, served_model)
    omni = to_omni(body)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    return body, omni, request_id, await _started(request.app.state.bridge, omni, request_id)


async def _parse(request: Request, schema: type[BaseModel]):
    try:
        payload = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    try:
        return schema.model_validate(payload)
    except ValidationError as error:
        raise validation_error(error) from None


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"model {requested!r} does not exist; this server serves {served!r}", param="model",
                       type="invalid_request_error", code="model_not_found")


async def _started(bridge: TritonBridge, omni: OmniRequest, request_id: str) -> AsyncIterator[Piece]:
    """The request's pieces, its first one already received (a refused request raises ApiError here); a failure
    later in the stream raises ApiError from the iterator."""
    stream = bridge.stream(omni.arrays(), request_id)
    try:
        first = await anext(stream, None)
    except TritonRequestError as error:
        raise from_triton(error, omni.params_of_inputs, request_id) from None

    async def pieces():
        try:
            if first is not None:
                yield first
            async for piece in stream:
                yield piece
        except TritonRequestError as error:
            raise from_triton(error, omni.params_of_inputs, request_id) from None
        finally:
            await stream.aclose()  # cancels the Triton request if it has not finished

    return pieces()


async def _unless_disconnected(request: Request, answer):
    """Await ``answer``, cancelling it (and with it the Triton request) if the client disconnects first."""
    work = asyncio.ensure_future(answer)

    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise ClientGone(request.url.path)
    return work.result()


class ChatAnswer:
    """One chat completion's answer, in OpenAI's shapes: chunks as SSE events, or one completion object."""

    def __init__(self, completion_id: str, model: str, body: ChatCompletionRequest, omni: OmniRequest,
                 counter: TokenCounter):
        self.completion_id, self.model, self.body, self.omni, self.counter = completion_id, model, body, omni, counter
        self.created = int(time.time())
        self.audio_id = f"audio_{uuid.uuid4().hex}" if "audio" in body.modalities else None
        self.max_tokens = body.max_completion_tokens or body.max_tokens

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
        yield sse(self._chunk({"role": "assistant", "content": ""}))
        text, samples = [], 0
        try:
            async for piece in pieces:
                delta: dict = {}
                if piece.text:
                    delta["content"] = piece.text
                    text.append(piece.text)
                if self.audio_id is not None:
                    audio: dict = {"id": self.audio_id}
                    if piece.audio is not None:
                        audio["data"] = base64.b64encode(pcm16_bytes(piece.audio)).decode()
                        samples += piece.audio.size
                    if piece.text:
                        audio["transcript"] = piece.text
                    delta["audio"] = audio
                yield sse(self._chunk(delta))
        except ApiError as error:  # the answer has started: the error goes in the stream, as OpenAI's does
            yield sse(error.body())
            return
        if self.audio_id is not None:  # the last audio update: its expiry (now: no audio is kept for later turns)
            yield sse(self._chunk({"audio": {"id": self.audio_id, "expires_at": self.created}}))
        usage = self._usage("".join(text), samples)
        yield sse(self._chunk({}, self._finish_reason(usage)))
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield sse({**self._header("chat.completion.chunk"), "choices": [], "usage": usage.chat()})
        yield sse("[DONE]")

    async def whole(self, pieces: AsyncIterator[Piece]) -> dict:
        text, chunks = [], []
        async for piece in pieces:
            text.append(piece.text)
            if piece.audio is not None:
                chunks.append(piece.audio)
        reply = "".join(text)
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        message: dict = {"role": "assistant", "content": reply}
        if self.audio_id is not None:
            audio_format = self.body.audio.format if self.body.audio else "wav"
            data = wav_bytes(audio) if audio_format == "wav" else pcm16_bytes(audio)
            # expires_at: now, since this server keeps no audio for later turns (it takes one user turn)
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(), "transcript": reply,
                                "expires_at": self.created}
        usage = self._usage(reply, audio.size)
        return {**self._header("chat.completion"),
                "choices": [{"index": 0, "message": message, "finish_reason": self._finish_reason(usage)}],
                "usage": usage.chat()}

    def _header(self, kind: str) -> dict:
        return {"id": self.completion_id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {**self._header("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    def _usage(self, reply: str, samples: int) -> Usage:
        turn = self.omni.turn
        return self.counter.usage(turn.text, 0 if turn.audio is None else turn.audio.size, reply, samples)

    def _finish_reason(self, usage: Usage) -> str:
        limited = self.max_tokens is not None and usage.text_tokens is not None and usage.text_tokens >= self.max_tokens
        return "length" if limited else "stop"


class SpeechAnswer:
    """One speech response: the audio in ``response_format`` (a streamed WAV is a header of unknown length, then
    PCM) as raw bytes or as SSE events; the text the model spoke counts in ``usage`` only."""

    def __init__(self, pieces: AsyncIterator[Piece], response_format: str):
        self.pieces, self.response_format = pieces, response_format
        self.samples, self.transcript = 0, []

    async def audio(self) -> AsyncIterator[bytes]:
        if self.response_format == "wav":
            yield streamed_wav_header()
        async for piece in self.pieces:
            self.transcript.append(piece.text)
            if piece.audio is not None:
                self.samples += piece.audio.size
                yield pcm16_bytes(piece.audio)

    async def events(self, omni: OmniRequest, counter: TokenCounter) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.audio():
                yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
        except ApiError as error:
            yield sse(error.body())
            return
        usage = counter.usage(omni.turn.text, 0, "".join(self.transcript), self.samples)
        yield sse({"type": "speech.audio.done", "usage": usage.speech()})
