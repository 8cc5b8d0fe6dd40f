"""Request bodies of the OpenAI endpoints this server takes, as pydantic models.

Fields this server does not implement are refused (``extra="forbid"``), so a client never gets an answer that
silently ignored what it asked for; each refusal is a 400 naming the field (``validation_errors``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_triton.api.errors import ApiError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class InputAudio(_Strict):
    data: str = Field(description="base64 of a WAV file")
    format: Literal["wav"]


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, AudioPart], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class AudioOutput(_Strict):
    voice: str | None = Field(None, description="a speaker of the checkpoint (e.g. ethan); absent: the server's")
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(_Strict):
    include_usage: bool = False


class OmniExtensions(_Strict):
    """Inputs of the ``omni`` model beyond OpenAI's fields (the SDK sends them with ``extra_body``), named as the
    model's inputs; absent: the server's defaults. The ranges are the server's to check (it names the field)."""

    max_audio_frames: int | None = Field(None, description="codec frames at most, 12.5 per second (0: no limit)")
    min_audio_frames: int | None = None
    min_tokens: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    talker_repetition_penalty: float | None = None
    ignore_eos: bool | None = Field(None, description="generate max_tokens exactly (benchmarks)")

    def extension_inputs(self) -> dict:
        return {name: getattr(self, name) for name in OmniExtensions.model_fields}


class ChatCompletionRequest(OmniExtensions):
    model: str
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = ["text"]
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    n: Literal[1] | None = None
    # accepted and not used: they change nothing about the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


class SpeechRequest(OmniExtensions):
    model: str
    input: str = Field(min_length=1)
    voice: str | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"
    speed: float = 1.0
    instructions: str | None = None
    seed: int | None = None  # an extension too: the same seed speaks the same audio


def validation_error(error: ValidationError) -> ApiError:
    """The most specific problem pydantic found, as a 400 naming its field (``messages[0].content[1].text``)."""
    problem = max(error.errors(), key=lambda e: len(e["loc"]))  # deepest: inside the union member that fit
    param = field_path(problem["loc"])
    if problem["type"] == "extra_forbidden":
        message = "is not supported by this server"
    elif problem["type"] == "missing":
        message = "is required"
    else:
        message = f"is invalid: {problem['msg']}"
    return ApiError(400, f"{param or 'body'} {message}", param=param or None, code="invalid_value")


_CONTENT_TAGS = {"text", "input_audio", "input_text", "output_text", "output_audio", "audio"}


def field_path(location: tuple) -> str:
    """pydantic's error location as the request field it names: union member labels (``str``,
    ``list[tagged-union[...]]``) and a content part's tag are left out."""
    parts = [part for part in location if not (isinstance(part, str) and ("[" in part or part in ("str", "body")))]
    path = ""
    for i, part in enumerate(parts):
        if i >= 2 and isinstance(parts[i - 1], int) and parts[i - 2] == "content" and part in _CONTENT_TAGS:
            continue  # the discriminator's value, not a field
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
