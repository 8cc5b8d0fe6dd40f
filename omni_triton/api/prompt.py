"""OpenAI requests -> the ``omni`` model's inputs (``omni_triton.client.request_arrays``), and back: which request
field set each Triton input, so that the model's INVALID_ARG ("SPEAKER must be one of ...") names the field
the client sent.

The model takes one user turn: text, spoken input (a 16 kHz waveform), or both. System prompts and earlier
turns have no input to go to, so they are refused rather than dropped.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass

import numpy as np

from omni_triton.api.errors import invalid
from omni_triton.api.schema import AudioPart, ChatCompletionRequest, OmniExtensions, SpeechRequest, TextPart
from omni_triton.client import read_wav, request_arrays

# Triton input -> request field, per endpoint (the extensions go by the input's own name)
EXTENSION_PARAMS = {name.upper(): name for name in OmniExtensions.model_fields}
CHAT_PARAMS = {**EXTENSION_PARAMS, "TEXT": "messages", "AUDIO_IN": "messages", "SPEAKER": "audio.voice",
               "TEMPERATURE": "temperature", "TOP_P": "top_p", "SEED": "seed", "RETURN_AUDIO": "modalities"}
SPEECH_PARAMS = {**EXTENSION_PARAMS, "TEXT": "input", "SPEAKER": "voice", "SEED": "seed",
                 "RETURN_AUDIO": "response_format"}
# a realtime response: the session setting or the conversation part behind each input
REALTIME_PARAMS = {"TEXT": "item", "AUDIO_IN": "input_audio_buffer", "HISTORY": "conversation",
                   "SPEAKER": "session.audio.output.voice", "MAX_TOKENS": "session.max_output_tokens",
                   "RETURN_AUDIO": "session.output_modalities"}


@dataclass
class UserTurn:
    text: str
    audio: np.ndarray | None  # float32 at 16 kHz
    history: list[dict] | None = None  # earlier messages ({"role", "content": text}), oldest first


@dataclass
class OmniRequest:
    """What one API request asks of the ``omni`` model."""

    turn: UserTurn
    scalars: dict  # request_arrays' keyword inputs
    params_of_inputs: dict[str, str]

    def arrays(self) -> dict[str, np.ndarray]:
        """The ``omni`` request's input tensors by name."""
        history = json.dumps(self.turn.history) if self.turn.history else None
        return request_arrays(self.turn.text, self.turn.audio, history=history, **self.scalars)


def user_turn(request: ChatCompletionRequest) -> UserTurn:
    if len(request.messages) != 1 or request.messages[0].role != "user":
        roles = [message.role for message in request.messages]
        raise invalid("messages", f"must be one user message (text and input_audio parts), got roles {roles}: "
                                  "the model serves a single user turn; system prompts and earlier turns are not "
                                  "supported")
    content = request.messages[0].content
    if content is None or isinstance(content, str):
        return UserTurn(content or "", None)
    texts, audio = [], None
    for index, part in enumerate(content):
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, AudioPart):
            if audio is not None:
                raise invalid(f"messages[0].content[{index}]", "is a second input_audio part: send one audio clip")
            audio = decode_wav(part.input_audio.data, f"messages[0].content[{index}].input_audio.data")
    return UserTurn("\n".join(texts), audio)


def decode_wav(data: str, param: str) -> np.ndarray:
    try:
        return read_wav(io.BytesIO(base64.b64decode(data, validate=True)))
    except binascii.Error as error:
        raise invalid(param, f"is not base64: {error}") from None
    except ValueError as error:
        raise invalid(param, f"is not a PCM WAV file: {error}") from None


def chat_request(request: ChatCompletionRequest) -> OmniRequest:
    if "text" not in request.modalities:
        raise invalid("modalities", f"must include 'text' (['text'] or ['text', 'audio']), got {request.modalities}")
    wants_audio = "audio" in request.modalities
    if wants_audio and request.stream and request.audio is not None and request.audio.format != "pcm16":
        raise invalid("audio.format", f"must be pcm16 when stream is true (streamed audio is raw 16-bit PCM "
                                      f"chunks), got {request.audio.format!r}")
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = dict(CHAT_PARAMS, MAX_TOKENS="max_completion_tokens" if request.max_completion_tokens else "max_tokens")
    scalars = dict(request.extension_inputs(), max_tokens=max_tokens, temperature=request.temperature,
                   top_p=request.top_p, seed=request.seed, speaker=request.audio.voice if request.audio else None,
                   return_audio=wants_audio)
    return OmniRequest(user_turn(request), scalars, params)


def speech_request(request: SpeechRequest) -> OmniRequest:
    if request.speed != 1.0:
        raise invalid("speed", f"must be 1.0 (the model speaks at one pace), got {request.speed}")
    if request.instructions:
        raise invalid("instructions", "are not supported by this model")
    scalars = dict(request.extension_inputs(), speaker=request.voice, seed=request.seed, return_audio=True)
    return OmniRequest(UserTurn(request.input, None), scalars, SPEECH_PARAMS)


def realtime_request(turn: UserTurn, voice: str | None, max_output_tokens: int | str, audio_out: bool,
                     max_audio_frames: int | None = None) -> OmniRequest:
    """One realtime response: the conversation's last user turn with its history; ``max_output_tokens`` "inf"
    leaves the server's default cap; ``max_audio_frames`` None: until the talker stops."""
    max_tokens = None if max_output_tokens == "inf" else max_output_tokens
    scalars = dict(speaker=voice, max_tokens=max_tokens, return_audio=audio_out, max_audio_frames=max_audio_frames)
    return OmniRequest(turn, scalars, REALTIME_PARAMS)
