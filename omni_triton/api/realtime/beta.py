"""The Realtime API's beta dialect, for clients that connect with ``OpenAI-Beta: realtime=v1`` (the official
client's ``client.beta.realtime``, older voice-agent stacks): its flat session fields and event names,
translated to and from the GA ones the connection works in.

Beta sessions say ``modalities`` ``["text", "audio"]`` (GA: ``output_modalities: ["audio"]``, a transcript
always comes with audio), ``voice``, ``input_audio_format`` / ``output_audio_format`` ``"pcm16"``,
``turn_detection`` and ``max_response_output_tokens`` at the top level; replies stream as
``response.audio.delta`` / ``response.audio_transcript.delta`` / ``response.text.delta``; items are announced
by ``conversation.item.created`` only, and an assistant's content parts are ``audio`` / ``text``.
"""

from __future__ import annotations

HEADER_VALUE = "realtime=v1"  # of the OpenAI-Beta header
SERVER_EVENTS = {f"response.output_{ga}.{end}": f"response.{beta}.{end}"
                 for ga, beta in (("audio", "audio"), ("audio_transcript", "audio_transcript"), ("text", "text"))
                 for end in ("delta", "done")}
GA_ONLY_EVENTS = {"conversation.item.added", "conversation.item.done"}
CONTENT_TYPES = {"output_audio": "audio", "output_text": "text"}
AUDIO_FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24000}}


def wants_beta(headers) -> bool:
    return headers.get("openai-beta", "").strip() == HEADER_VALUE


def client_event(payload: dict) -> dict:
    """A beta client event in GA shape (only session.update and response.create differ)."""
    if payload.get("type") == "session.update" and isinstance(payload.get("session"), dict):
        return {**payload, "session": _settings(payload["session"], "max_response_output_tokens")}
    if payload.get("type") == "response.create" and isinstance(payload.get("response"), dict):
        return {**payload, "response": _settings(payload["response"], "max_response_output_tokens")}
    return payload


def _settings(beta: dict, max_tokens_key: str) -> dict:
    ga, audio_in, audio_out = {}, {}, {}
    for key, value in beta.items():
        if key == "modalities":
            ga["output_modalities"] = ["audio"] if isinstance(value, list) and "audio" in value else value
        elif key == "voice":
            audio_out["voice"] = value
        elif key in ("input_audio_format", "output_audio_format"):
            # an unknown format goes through as its name, for the GA schema to refuse by field
            fmt = AUDIO_FORMATS.get(value, {"type": value})
            (audio_in if key.startswith("input") else audio_out)["format"] = fmt
        elif key == "turn_detection":
            audio_in["turn_detection"] = value
        elif key == max_tokens_key:
            ga["max_output_tokens"] = value
        else:
            ga[key] = value
    audio = {name: part for name, part in (("input", audio_in), ("output", audio_out)) if part}
    return {**ga, "audio": audio} if audio else ga


def session(ga: dict) -> dict:
    """The GA session as a beta client reads it."""
    audio = ga["audio"]
    flat = {key: value for key, value in ga.items() if key not in ("audio", "output_modalities", "max_output_tokens")}
    return {**flat, "modalities": ["text", "audio"] if ga["output_modalities"] == ["audio"] else ["text"],
            "voice": audio["output"]["voice"], "input_audio_format": "pcm16", "output_audio_format": "pcm16",
            "turn_detection": audio["input"]["turn_detection"],
            "max_response_output_tokens": ga["max_output_tokens"]}


def server_event(kind: str, fields: dict) -> tuple[str, dict] | None:
    """A GA server event as a beta client expects it; None for one it does not know."""
    if kind in GA_ONLY_EVENTS:
        return None
    return SERVER_EVENTS.get(kind, kind), _content_renamed(fields)


def _content_renamed(value):
    if isinstance(value, dict):
        out = {key: _content_renamed(inner) for key, inner in value.items()}
        if out.get("type") in CONTENT_TYPES and ("transcript" in out or "text" in out):
            out["type"] = CONTENT_TYPES[out["type"]]
        return out
    if isinstance(value, list):
        return [_content_renamed(inner) for inner in value]
    return value
