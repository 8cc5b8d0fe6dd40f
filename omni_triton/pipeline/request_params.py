"""Client request tensors -> validated, typed request parameters (pure logic, no Triton imports).

Every problem raises InvalidRequest naming the input and the value, so the preprocess model can turn it
into an INVALID_ARG error the client can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

AUDIO_IN_SAMPLE_RATE = 16000
MIN_AUDIO_SAMPLES = 1600  # 0.1 s: shorter input has too few mel frames to encode
HISTORY_ROLES = ("system", "user", "assistant")


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


@dataclass(frozen=True)
class RequestLimits:
    max_text_chars: int = 8000
    max_audio_seconds: float = 60.0
    max_tokens_cap: int = 2048
    default_max_tokens: int = 256
    max_audio_frames_cap: int = 4096


# transformers' Qwen3OmniMoeForConditionalGeneration.generate(talker_repetition_penalty=1.05)
TALKER_REPETITION_PENALTY = 1.05


@dataclass(frozen=True)
class SamplingDefaults:
    """Thinker sampling defaults; the checkpoint's generation_config.json overrides them. Temperature, top-p and
    top-k are Qwen's recommended sampling (a speech reply sampled, not greedy). The repetition penalty is
    transformers' generate() default for the thinker, 1.0 (none), so TEMPERATURE 0 alone is its greedy decoding;
    the talker's penalty is separate (TALKER_REPETITION_PENALTY)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    repetition_penalty: float = 1.0

    @classmethod
    def from_generation_config(cls, generation_config: Mapping) -> "SamplingDefaults":
        keys = ("temperature", "top_p", "top_k", "repetition_penalty")
        return cls(**{k: type(getattr(cls, k))(generation_config[k]) for k in keys if k in generation_config})


@dataclass(frozen=True)
class RequestParams:
    text: str
    audio: np.ndarray | None  # float32 [S] at 16 kHz, or None
    max_tokens: int
    min_tokens: int
    speaker: str
    speaker_id: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    talker_repetition_penalty: float
    seed: int                 # -1: unseeded (a fresh random seed)
    return_audio: bool
    ignore_eos: bool
    max_audio_frames: int     # 0: until the talker stops
    min_audio_frames: int
    sequential: bool
    # the turns before this one, oldest first: ({"role": system/user/assistant, "content": text}, ...)
    history: tuple[dict, ...] = ()


def parse_request(inputs: Mapping[str, np.ndarray | None], limits: RequestLimits,
                  speakers: Mapping[str, int], defaults: SamplingDefaults = SamplingDefaults()) -> RequestParams:
    """Validate the client's inputs (absent optional inputs are None or missing) into RequestParams."""
    audio = _audio(inputs.get("AUDIO_IN"), limits)
    if inputs.get("TEXT") is None and audio is None:
        raise InvalidRequest("TEXT", "is required when no AUDIO_IN is given: send TEXT, AUDIO_IN or both")
    text = _text(inputs.get("TEXT"), limits)
    if not text.strip() and audio is None:
        raise InvalidRequest("TEXT", "must not be empty when no AUDIO_IN is given")

    max_tokens = _int(inputs, "MAX_TOKENS", np.int32, limits.default_max_tokens, 1, limits.max_tokens_cap)
    min_tokens = _int(inputs, "MIN_TOKENS", np.int32, 0, 0, max_tokens)
    speaker, speaker_id = _speaker(inputs.get("SPEAKER"), speakers)
    temperature = _float(inputs, "TEMPERATURE", defaults.temperature, low=0.0)
    top_p = _float(inputs, "TOP_P", defaults.top_p, low=0.0, low_open=True, high=1.0)
    top_k = _int(inputs, "TOP_K", np.int32, defaults.top_k, 0, 2**31 - 1)
    repetition_penalty = _float(inputs, "REPETITION_PENALTY", defaults.repetition_penalty, low=0.0, low_open=True)
    talker_repetition_penalty = _float(inputs, "TALKER_REPETITION_PENALTY", TALKER_REPETITION_PENALTY, low=0.0,
                                       low_open=True)
    seed = _int(inputs, "SEED", np.int64, -1, -1, 2**63 - 1)
    max_audio_frames = _int(inputs, "MAX_AUDIO_FRAMES", np.int32, 0, 0, limits.max_audio_frames_cap)
    min_audio_frames = _int(inputs, "MIN_AUDIO_FRAMES", np.int32, 0, 0,
                            max_audio_frames or limits.max_audio_frames_cap)
    return RequestParams(
        text=text, audio=audio, max_tokens=max_tokens, min_tokens=min_tokens, speaker=speaker,
        speaker_id=speaker_id, temperature=temperature, top_p=top_p, top_k=top_k,
        repetition_penalty=repetition_penalty, talker_repetition_penalty=talker_repetition_penalty, seed=seed,
        return_audio=_bool(inputs, "RETURN_AUDIO", True), ignore_eos=_bool(inputs, "IGNORE_EOS", False),
        max_audio_frames=max_audio_frames, min_audio_frames=min_audio_frames,
        sequential=_bool(inputs, "SEQUENTIAL", False), history=_history(inputs.get("HISTORY"), limits),
    )


def check_context(num_prompt_tokens: int, max_tokens: int, context_tokens: int, field: str = "TEXT") -> None:
    """The prompt plus the tokens to generate must fit the model's context / KV budget (``field``: the input
    blamed, HISTORY when earlier turns are part of the prompt)."""
    if num_prompt_tokens + max_tokens > context_tokens:
        raise InvalidRequest(field, f"is too long: the prompt is {num_prompt_tokens} tokens and MAX_TOKENS is "
                                     f"{max_tokens}, more than the context of {context_tokens} tokens")


def _scalar(inputs: Mapping[str, np.ndarray | None], name: str, kinds: str) -> np.generic | None:
    value = inputs.get(name)
    if value is None:
        return None
    value = np.asarray(value)
    if value.dtype.kind not in kinds:
        raise InvalidRequest(name, f"has the wrong datatype {value.dtype}")
    if value.size != 1:
        raise InvalidRequest(name, f"must hold exactly one value, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _int(inputs, name: str, dtype, default: int, low: int, high: int) -> int:
    value = _scalar(inputs, name, "iu")
    if value is None:
        return default
    value = int(value)
    if not low <= value <= high:
        raise InvalidRequest(name, f"must be in [{low}, {high}], got {value}")
    return value


def _float(inputs, name: str, default: float, *, low: float, low_open: bool = False,
           high: float = math.inf) -> float:
    value = _scalar(inputs, name, "f")
    if value is None:
        return default
    value = float(value)
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise InvalidRequest(name, f"must be a finite number in {interval}, got {value}")
    return value


def _bool(inputs, name: str, default: bool) -> bool:
    value = _scalar(inputs, name, "b")
    return default if value is None else bool(value)


def _utf8(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise InvalidRequest(name, f"must be BYTES (UTF-8 text), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(name, f"is not valid UTF-8: {error}") from None


def _text(value: np.ndarray | None, limits: RequestLimits) -> str:
    if value is None:
        return ""  # spoken input only
    text = _utf8("TEXT", _scalar({"TEXT": value}, "TEXT", "OSU"))
    if len(text) > limits.max_text_chars:
        raise InvalidRequest("TEXT", f"is {len(text)} characters, more than the limit of {limits.max_text_chars}")
    return text


def _history(value: np.ndarray | None, limits: RequestLimits) -> tuple[dict, ...]:
    """HISTORY: a JSON list of earlier messages, ``[{"role": "system"|"user"|"assistant", "content": "text"}]``,
    each content within the text limit (the whole prompt is bounded by the context, check_context)."""
    if value is None:
        return ()
    raw = _utf8("HISTORY", _scalar({"HISTORY": value}, "HISTORY", "OSU"))
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as error:
        raise InvalidRequest("HISTORY", f"is not JSON: {error}") from None
    if not isinstance(messages, list):
        raise InvalidRequest("HISTORY", f"must be a JSON list of messages, got {type(messages).__name__}")
    history = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise InvalidRequest("HISTORY", f"[{index}] must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in HISTORY_ROLES:
            raise InvalidRequest("HISTORY", f"[{index}].role must be one of {list(HISTORY_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRequest("HISTORY", f"[{index}].content must be a string, got {type(content).__name__}")
        if len(content) > limits.max_text_chars:
            raise InvalidRequest("HISTORY", f"[{index}].content is {len(content)} characters, more than the limit "
                                            f"of {limits.max_text_chars}")
        history.append({"role": role, "content": content})
    return tuple(history)


def _speaker(value: np.ndarray | None, speakers: Mapping[str, int]) -> tuple[str, int]:
    names = {name.lower(): speaker_id for name, speaker_id in speakers.items()}
    if value is None:
        name = "ethan" if "ethan" in names else min(names)
    else:
        name = _utf8("SPEAKER", _scalar({"SPEAKER": value}, "SPEAKER", "OSU")).strip().lower()
    if name not in names:
        raise InvalidRequest("SPEAKER", f"must be one of {sorted(names)}, got {name!r}")
    return name, names[name]


def _audio(value: np.ndarray | None, limits: RequestLimits) -> np.ndarray | None:
    if value is None:
        return None
    audio = np.asarray(value)
    if audio.dtype != np.float32:
        raise InvalidRequest("AUDIO_IN", f"must be FP32, got {audio.dtype}")
    if audio.ndim != 1:
        raise InvalidRequest("AUDIO_IN", f"must be a mono waveform of shape [samples], got {list(audio.shape)}")
    max_samples = int(limits.max_audio_seconds * AUDIO_IN_SAMPLE_RATE)
    if not MIN_AUDIO_SAMPLES <= audio.size <= max_samples:
        raise InvalidRequest("AUDIO_IN", f"must hold {MIN_AUDIO_SAMPLES} to {max_samples} samples "
                                         f"({limits.max_audio_seconds:g} s at 16 kHz), got {audio.size}")
    if not np.isfinite(audio).all():
        raise InvalidRequest("AUDIO_IN", "contains NaN or infinite samples")
    return audio
