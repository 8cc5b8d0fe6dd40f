"""A realtime session's settings: ``session.update`` merges into them, ``response.create`` overrides them."""

from __future__ import annotations

from dataclasses import dataclass

from omni_triton.api.errors import invalid
from omni_triton.api.realtime.events import ResponseOptions, Session, checked
from omni_triton.api.realtime.vad import VadSettings


def merged(base: dict, changes: dict) -> dict:
    """``changes`` over ``base``, nested objects merged key by key (a partial ``session.update``)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def updated_session(session: Session, changes: dict, served_model: str) -> Session:
    new = checked(Session, merged(session.model_dump(), changes), "session")
    if new.model not in (None, served_model):
        raise invalid("session.model", f"must be {served_model!r}, the model this server serves; got {new.model!r}")
    return new


def vad_settings(session: Session) -> VadSettings | None:
    detection = session.audio.input.turn_detection
    if detection is None:
        return None
    return VadSettings(detection.threshold, detection.prefix_padding_ms, detection.silence_duration_ms)


@dataclass(frozen=True)
class ResponseSettings:
    instructions: str
    audio_out: bool
    voice: str | None
    max_output_tokens: int | str


def response_settings(session: Session, options: ResponseOptions | None) -> ResponseSettings:
    """The session's settings with a ``response.create``'s overrides."""
    options = options or ResponseOptions()
    voice = session.audio.output.voice
    if options.audio is not None and options.audio.output.voice is not None:
        voice = options.audio.output.voice
    modalities = options.output_modalities or session.output_modalities
    return ResponseSettings(
        instructions=session.instructions if options.instructions is None else options.instructions,
        audio_out=modalities == ["audio"], voice=voice,
        max_output_tokens=session.max_output_tokens if options.max_output_tokens is None
        else options.max_output_tokens)
