"""The Realtime API's client events this server takes (GA names and shapes, as the official ``openai`` client
sends them), as pydantic models that refuse what they do not implement, and the server events' envelope.

A bad event is answered with an ``error`` event in OpenAI's shape naming the field (``session.audio.input.
turn_detection.threshold``) and the client event's ``event_id``; the session goes on.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_triton.api.errors import ApiError
from omni_triton.api.schema import validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AudioFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class ServerVad(_Strict):
    type: Literal["server_vad"]
    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=32, le=10000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None  # accepted as null only: the server does not nudge a silent user


class AudioInput(_Strict):
    format: AudioFormat = AudioFormat()
    turn_detection: ServerVad | None = ServerVad(type="server_vad")
    transcription: None = None  # no separate transcription model: the user's audio goes to the model as audio
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: AudioFormat = AudioFormat()
    voice: str | None = Field(None, description="a speaker of the checkpoint (e.g. ethan); absent: the server's")
    speed: Literal[1.0] = 1.0


class Audio(_Strict):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


class ResponseAudio(_Strict):
    output: AudioOutput = AudioOutput()


MaxOutputTokens = Union[Annotated[int, Field(ge=1)], Literal["inf"]]


class Session(_Strict):
    """The session's settings: ``session.update`` changes the fields it sends (nested objects merge)."""

    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str = ""
    output_modalities: list[Literal["audio", "text"]] = Field(["audio"], min_length=1, max_length=1)
    max_output_tokens: MaxOutputTokens = "inf"
    audio: Audio = Audio()
    tools: list[dict] = Field([], max_length=0, description="no tool calls: an empty list only")
    tool_choice: Literal["auto", "none"] = "auto"


class ResponseOptions(_Strict):
    """``response.create``'s ``response``: this response's overrides of the session."""

    instructions: str | None = None
    output_modalities: list[Literal["audio", "text"]] | None = Field(None, min_length=1, max_length=1)
    max_output_tokens: MaxOutputTokens | None = None
    audio: ResponseAudio | None = None
    conversation: Literal["auto"] = "auto"
    metadata: dict[str, str] | None = None


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputAudio(_Strict):
    type: Literal["input_audio"]
    audio: str | None = None  # base64 pcm16, 24 kHz
    transcript: str | None = None


class OutputText(_Strict):
    type: Literal["output_text", "text"]
    text: str


class OutputAudio(_Strict):
    type: Literal["output_audio", "audio"]
    transcript: str | None = None


Content = Annotated[Union[InputText, InputAudio, OutputText, OutputAudio], Field(discriminator="type")]


class Item(_Strict):
    id: str | None = Field(None, max_length=64)
    type: Literal["message"]
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["system", "user", "assistant"]
    content: list[Content] = Field(min_length=1)


class _Event(_Strict):
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict  # merged into the session, then checked as a whole (Session)


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseOptions | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


class OutputAudioClear(_Event):
    type: Literal["output_audio_buffer.clear"]


CLIENT_EVENTS = {model.model_fields["type"].annotation.__args__[0]: model for model in (
    SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ItemDelete, ItemTruncate, ItemRetrieve,
    ResponseCreate, ResponseCancel, OutputAudioClear)}


def parse_client_event(payload) -> _Event:
    """A client event (a decoded JSON frame) as its model; ApiError naming the bad field."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the event must be a JSON object", code="invalid_event")
    kind = payload.get("type")
    model = CLIENT_EVENTS.get(kind)
    if model is None:
        raise ApiError(400, f"type {kind!r} is not a client event this server takes: {sorted(CLIENT_EVENTS)}",
                       param="type", code="invalid_event")
    return checked(model, payload)


def checked(model: type[BaseModel], payload, prefix: str = ""):
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        problem = validation_error(error)
        if prefix:
            problem.param = f"{prefix}.{problem.param}" if problem.param else prefix
            problem.message = f"{prefix}.{problem.message}"
        raise problem from None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def server_event(kind: str, **fields) -> dict:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: ApiError, client_event_id: str | None = None) -> dict:
    return server_event("error", error={"type": error.type, "code": error.code, "message": error.message,
                                        "param": error.param, "event_id": client_event_id})
