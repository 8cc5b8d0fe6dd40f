"""One ``/v1/realtime`` WebSocket: client events in, server events out, at most one response at a time.

Events are handled in order on the connection's task; a response streams on a task of its own (Triton request
through the API's ``TritonBridge``), so audio keeps arriving while the client talks. The VAD runs in the
default executor. When it hears speech while a response is under way (``interrupt_response``), the response is
cancelled at once: its Triton request is cancelled (the bridge's cancel reaches every stage), its transcript is
cut to the audio sent, and the client's ``conversation.item.truncate`` cuts it to what was played.

The session ends when the client closes, after ``idle_timeout_s`` without a client event, or at
``max_session_s``; its response, buffer and conversation go with it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from omni_triton.api.bridge import TritonBridge
from omni_triton.api.encoding import pcm16_bytes
from omni_triton.api.errors import ApiError, TritonRequestError, from_triton, invalid
from omni_triton.api.prompt import UserTurn, realtime_request
from omni_triton.api.realtime import beta
from omni_triton.api.realtime import events as ev
from omni_triton.api.realtime.audio import InputAudioBuffer, decode_pcm16
from omni_triton.api.realtime.conversation import Conversation, ConversationItem
from omni_triton.api.realtime.limits import RealtimeLimits
from omni_triton.api.realtime.session import response_settings, updated_session, vad_settings
from omni_triton.api.realtime.vad import SpeechDetector
from omni_triton.api.usage import TokenCounter
from omni_triton.client import resample

logger = logging.getLogger("omni_triton.api.realtime")
MIN_COMMIT_MS = 100  # OpenAI's least committable input audio


@dataclass
class Response:
    id: str
    item: ConversationItem
    settings: object  # session.ResponseSettings
    turn: UserTurn
    task: asyncio.Task | None = None
    cancel_reason: str | None = None  # turn_detected | client_cancelled, once cancelled


class RealtimeConnection:
    def __init__(self, websocket: WebSocket, bridge: TritonBridge, counter: TokenCounter, model: str,
                 limits: RealtimeLimits):
        self.websocket, self.bridge, self.counter, self.model, self.limits = websocket, bridge, counter, model, limits
        self.session = ev.Session(model=model)
        self.session_id = ev.new_id("sess")
        self.beta = beta.wants_beta(websocket.headers)  # the beta dialect's fields and event names (beta.py)
        tokenizer = counter.chat.tokenizer if counter.chat is not None else None
        self.conversation = Conversation(limits.max_items, tokenizer)
        self.buffer = InputAudioBuffer(limits.max_input_audio_s)
        self.detector: SpeechDetector | None = None
        self.speech_start_ms: int | None = None
        self.speech_item_id = ev.new_id("item")  # the id the buffer's audio gets when committed
        self.response: Response | None = None
        self.send_lock = asyncio.Lock()
        self.open = True

    # -- the connection's life ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.websocket.accept()
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self.limits.max_session_s
        try:
            await self.send("session.created", session=self.session_wire())
            await self._reset_detector()
            while True:
                left = ends_at - loop.time()
                try:
                    async with asyncio.timeout(min(self.limits.idle_timeout_s, left)):
                        message = await self.websocket.receive()
                except TimeoutError:
                    await self.fail(self.ended(expired=left <= self.limits.idle_timeout_s))
                    break
                if message["type"] == "websocket.disconnect":
                    break
                # events are JSON text frames; a binary frame is read as UTF-8 text (and refused if not JSON)
                text = message.get("text")
                await self.handle(text if text is not None else (message.get("bytes") or b"").decode(errors="replace"))
        except WebSocketDisconnect:
            pass
        finally:
            self.open = False  # nothing more is sent: a response still running is cancelled silently
            await self.cancel_response(None)
            if self.websocket.client_state == WebSocketState.CONNECTED:
                await self.websocket.close()

    def ended(self, expired: bool) -> ApiError:
        if expired:
            return ApiError(408, f"session ended: it reached the limit of {self.limits.max_session_s:g} s",
                            code="session_expired")
        return ApiError(408, f"session ended: no client event for {self.limits.idle_timeout_s:g} s",
                        code="idle_timeout")

    async def handle(self, message: str) -> None:
        event_id = None
        try:
            try:
                payload = json.loads(message)
            except json.JSONDecodeError as error:
                raise ApiError(400, f"the event is not JSON: {error}", code="invalid_json") from None
            if isinstance(payload, dict):
                event_id = payload.get("event_id")
                if self.beta:
                    payload = beta.client_event(payload)
            event = ev.parse_client_event(payload)
            await getattr(self, "on_" + event.type.replace(".", "_"))(event)
        except ApiError as error:
            await self.fail(error, event_id)

    async def send(self, kind: str, **fields) -> None:
        if self.beta:
            translated = beta.server_event(kind, fields)
            if translated is None:
                return
            kind, fields = translated
        await self._write(ev.server_event(kind, **fields))

    async def fail(self, error: ApiError, event_id: str | None = None) -> None:
        await self._write(ev.error_event(error, event_id))

    async def _write(self, event: dict) -> None:
        if self.open:
            # shielded: a response cancelled while it sends a delta still sends that whole frame
            await asyncio.shield(self._write_frame(json.dumps(event, separators=(",", ":"))))

    async def _write_frame(self, text: str) -> None:
        async with self.send_lock:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError):  # the client went away mid-send
                self.open = False

    def session_wire(self) -> dict:
        settings = self.session.model_dump()
        return {"id": self.session_id, "object": "realtime.session",
                **(beta.session(settings) if self.beta else settings)}

    async def _reset_detector(self) -> None:
        settings = vad_settings(self.session)
        self.speech_start_ms = None
        self.detector = None if settings is None else await asyncio.get_running_loop().run_in_executor(
            None, SpeechDetector, settings)

    # -- session and input audio --------------------------------------------------------------------

    async def on_session_update(self, event: ev.SessionUpdate) -> None:
        before = self.session.audio.input.turn_detection
        self.session = updated_session(self.session, event.session, self.model)
        if self.session.audio.input.turn_detection != before:
            await self._reset_detector()
        await self.send("session.updated", session=self.session_wire())

    async def on_input_audio_buffer_append(self, event: ev.AudioAppend) -> None:
        samples = self.buffer.append(decode_pcm16(event.audio, "audio"))
        if self.detector is None or not samples.size:
            return
        detected = await asyncio.get_running_loop().run_in_executor(None, self.detector.feed, samples)
        for speech in detected:
            if speech.kind == "started":
                await self.speech_started(speech.ms)
            else:
                await self.speech_stopped(speech.ms)
        if not self.detector.speaking:  # silence between turns: only what a next turn's padding needs stays
            self.buffer.keep_last(self.detector.settings.prefix_padding_ms + 100)

    async def speech_started(self, ms: int) -> None:
        self.speech_start_ms = ms
        await self.send("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self.speech_item_id)
        detection = self.session.audio.input.turn_detection
        if self.response is not None and detection.interrupt_response:
            await self.cancel_response("turn_detected")

    async def speech_stopped(self, ms: int) -> None:
        await self.send("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=self.speech_item_id)
        await self.commit(self.speech_start_ms)
        self.speech_start_ms = None
        if self.session.audio.input.turn_detection.create_response and self.response is None:
            await self.start_response(None)

    async def on_input_audio_buffer_commit(self, event: ev.AudioCommit) -> None:
        if self.buffer.duration_ms < MIN_COMMIT_MS:
            raise ApiError(400, f"input_audio_buffer holds {self.buffer.duration_ms} ms of audio: at least "
                                f"{MIN_COMMIT_MS} ms is needed to commit", param="input_audio_buffer",
                           code="input_audio_buffer_commit_empty")
        await self.commit(None)

    async def commit(self, from_ms: int | None) -> None:
        item = ConversationItem(self.speech_item_id, "user", audio=self.buffer.take(from_ms))
        self.speech_item_id = ev.new_id("item")
        previous = self.conversation.add(item)
        await self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        await self.item_added(item, previous)

    async def on_input_audio_buffer_clear(self, event: ev.AudioClear) -> None:
        self.buffer.clear()
        await self.send("input_audio_buffer.cleared")

    async def on_output_audio_buffer_clear(self, event: ev.OutputAudioClear) -> None:
        # audio is sent as it is made: the server holds no output buffer to clear (the client stops playing)
        await self.send("output_audio_buffer.cleared", response_id=self.response.id if self.response else None)

    # -- conversation items ---------------------------------------------------------------------------

    async def item_added(self, item: ConversationItem, previous: str | None) -> None:
        wire = item.wire()
        # "created" is the beta name the GA clients still parse; "added" / "done" are GA's
        await self.send("conversation.item.created", previous_item_id=previous, item=wire)
        await self.send("conversation.item.added", previous_item_id=previous, item=wire)
        if item.status == "completed":
            await self.send("conversation.item.done", previous_item_id=previous, item=wire)

    async def on_conversation_item_create(self, event: ev.ItemCreate) -> None:
        item = _conversation_item(event.item)
        previous = self.conversation.add(item, event.previous_item_id)
        await self.item_added(item, previous)

    async def on_conversation_item_delete(self, event: ev.ItemDelete) -> None:
        if self.response is not None and self.response.item.id == event.item_id:
            raise invalid("item_id", f"{event.item_id!r} is the reply being made: cancel the response first")
        self.conversation.delete(event.item_id)
        await self.send("conversation.item.deleted", item_id=event.item_id)

    async def on_conversation_item_truncate(self, event: ev.ItemTruncate) -> None:
        self.conversation.get(event.item_id)  # an unknown id fails before anything is cancelled
        if self.response is not None and self.response.item.id == event.item_id:
            await self.cancel_response("client_cancelled")
        self.conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
        await self.send("conversation.item.truncated", item_id=event.item_id, content_index=event.content_index,
                        audio_end_ms=event.audio_end_ms)

    async def on_conversation_item_retrieve(self, event: ev.ItemRetrieve) -> None:
        await self.send("conversation.item.retrieved", item=self.conversation.get(event.item_id).wire())

    # -- responses -------------------------------------------------------------------------------------

    async def on_response_create(self, event: ev.ResponseCreate) -> None:
        if self.response is not None:
            raise ApiError(400, f"response {self.response.id} is still in progress: wait for its response.done or "
                                "cancel it", param="type", code="conversation_already_has_active_response")
        await self.start_response(event.response)

    async def on_response_cancel(self, event: ev.ResponseCancel) -> None:
        if self.response is None or event.response_id not in (None, self.response.id):
            raise ApiError(400, "there is no response in progress to cancel" if self.response is None else
                           f"response_id {event.response_id!r} is not the response in progress",
                           param="response_id", code="response_cancel_not_active")
        await self.cancel_response("client_cancelled")

    async def start_response(self, options: ev.ResponseOptions | None) -> None:
        settings = response_settings(self.session, options)
        conversation_turn = self.conversation.turn(settings.instructions)
        turn = UserTurn(conversation_turn.text, conversation_turn.audio, conversation_turn.history)
        item = ConversationItem(ev.new_id("item"), "assistant", output_audio=settings.audio_out, status="in_progress")
        previous = self.conversation.add(item)  # first: a full conversation refuses the response here
        response = Response(ev.new_id("resp"), item, settings, turn)
        self.response = response
        await self.send("response.created", response=self.response_wire(response, "in_progress"))
        await self.send("response.output_item.added", response_id=response.id, output_index=0, item=item.wire())
        await self.item_added(item, previous)
        await self.send("response.content_part.added", **self.part_of(response), part=self.part_wire(response))
        omni = realtime_request(turn, settings.voice, settings.max_output_tokens, settings.audio_out,
                                self.limits.max_output_audio_frames())
        response.task = asyncio.get_running_loop().create_task(self.stream(response, omni))

    async def stream(self, response: Response, omni) -> None:
        """Send the response's deltas as Triton makes them; then its done events (also after a cancel)."""
        item, status, details = response.item, "completed", None
        text_kind = "response.output_audio_transcript.delta" if item.output_audio else "response.output_text.delta"
        pieces = self.bridge.stream(omni.arrays(), response.id)
        try:
            async for piece in pieces:
                if piece.text:
                    item.text += piece.text
                    await self.send(text_kind, **self.part_of(response), delta=piece.text)
                if piece.audio is not None and item.output_audio:
                    item.audio_samples += piece.audio.size
                    delta = base64.b64encode(pcm16_bytes(piece.audio)).decode()
                    await self.send("response.output_audio.delta", **self.part_of(response), delta=delta)
        except TritonRequestError as failure:
            error = from_triton(failure, omni.params_of_inputs, response.id)
            await self.fail(error)
            status, details = "failed", {"type": "failed", "error": {"type": error.type, "code": error.code,
                                                                     "message": error.message}}
        except asyncio.CancelledError:  # cancel_response: the bridge cancels the Triton request as it unwinds
            status, details = "cancelled", {"type": "cancelled", "reason": response.cancel_reason}
        except Exception:  # a bug here must not leave the session with a response that never ends
            logger.exception("response %s failed", response.id)
            await self.fail(ApiError(500, f"internal server error (response {response.id})", type="server_error",
                                     code="internal_error"))
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": "internal_error"}}
        finally:
            await pieces.aclose()
        await self.finish(response, status, details)

    async def finish(self, response: Response, status: str, details: dict | None) -> None:
        item = response.item
        item.status = "completed" if status == "completed" else "incomplete"
        if status == "cancelled" and item.output_audio:
            self.conversation.cut_to_audio(item, item.audio_samples)  # the text not spoken yet goes
        if self.response is response:
            self.response = None
        where = self.part_of(response)
        if item.output_audio:
            await self.send("response.output_audio.done", **where)
            await self.send("response.output_audio_transcript.done", **where, transcript=item.text)
        else:
            await self.send("response.output_text.done", **where, text=item.text)
        await self.send("response.content_part.done", **where, part=self.part_wire(response))
        await self.send("response.output_item.done", response_id=response.id, output_index=0, item=item.wire())
        await self.send("conversation.item.done", item=item.wire())
        turn = response.turn
        usage = self.counter.usage(turn.text, 0 if turn.audio is None else turn.audio.size, item.text,
                                   item.audio_samples, turn.history)
        await self.send("response.done", response=self.response_wire(response, status, details, usage.realtime()))

    async def cancel_response(self, reason: str | None) -> None:
        """Cancel the response in progress (if any) and wait until its Triton request is being cancelled and its
        done events are sent."""
        response = self.response
        if response is None or response.task is None:
            return
        response.cancel_reason = reason
        response.task.cancel()
        try:
            await response.task
        except asyncio.CancelledError:  # cancelled before it started: nothing was sent to Triton
            pass
        if self.response is response:
            await self.finish(response, "cancelled", {"type": "cancelled", "reason": reason})

    def response_wire(self, response: Response, status: str, details: dict | None = None,
                      usage: dict | None = None) -> dict:
        settings = response.settings
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "conversation_id": None, "output": [response.item.wire()] if status != "in_progress" else [],
                "output_modalities": ["audio" if settings.audio_out else "text"],
                "max_output_tokens": settings.max_output_tokens, "metadata": None, "usage": usage,
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": settings.voice}}}

    @staticmethod
    def part_of(response: Response) -> dict:
        return {"response_id": response.id, "item_id": response.item.id, "output_index": 0, "content_index": 0}

    @staticmethod
    def part_wire(response: Response) -> dict:
        item = response.item
        return {"type": "audio", "transcript": item.text} if item.output_audio else {"type": "text", "text": item.text}


def _conversation_item(item: ev.Item) -> ConversationItem:
    """A client's item as the conversation keeps it; refuses content its role cannot have."""
    allowed = {"system": {"input_text"}, "user": {"input_text", "input_audio"},
               "assistant": {"output_text", "text", "output_audio", "audio"}}[item.role]
    texts, audio, transcript, spoken = [], [], None, False
    for index, part in enumerate(item.content):
        if part.type not in allowed:
            raise invalid(f"item.content[{index}].type", f"{part.type!r} is not content of a {item.role} item; "
                                                         f"it takes {sorted(allowed)}")
        if isinstance(part, (ev.InputText, ev.OutputText)):
            texts.append(part.text)
        elif isinstance(part, ev.InputAudio):
            if part.audio is None:
                raise invalid(f"item.content[{index}].audio", "is required (base64 pcm16 at 24 kHz)")
            pcm = decode_pcm16(part.audio, f"item.content[{index}].audio")
            audio.append(resample(pcm, 24000, 16000))
            transcript = part.transcript
        else:  # an assistant's spoken reply, known by its transcript
            texts.append(part.transcript or "")
            spoken = True
    return ConversationItem(item.id or ev.new_id("item"), item.role, text="\n".join(texts),
                            audio=np.concatenate(audio) if audio else None, audio_transcript=transcript,
                            output_audio=spoken)
