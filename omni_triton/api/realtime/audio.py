"""The session's input audio: base64 PCM16 at 24 kHz in (``input_audio_buffer.append``), kept at 16 kHz, the
rate of both the VAD and the model's AUDIO_IN.

24 kHz -> 16 kHz is linear interpolation (as ``omni_triton.client.resample``) done chunk by chunk: three input
samples make two output samples, so converting whole triples as they arrive (the rest waits for the next
append) gives the samples that converting the whole stream at once would.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from omni_triton.api.errors import ApiError, invalid
from omni_triton.client import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, resample

CLIENT_RATE = OUTPUT_SAMPLE_RATE  # pcm16 at 24 kHz, in and out, as OpenAI's audio/pcm


def decode_pcm16(data: str, param: str) -> np.ndarray:
    """base64 little-endian 16-bit PCM -> float32 in [-1, 1)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise invalid(param, f"is not base64: {error}") from None
    if len(raw) % 2:
        raise invalid(param, f"must be whole 16-bit samples, got {len(raw)} bytes")
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0


class InputAudioBuffer:
    """Audio appended since the last commit or clear, at 16 kHz, placed on the session's input timeline (ms
    since the session's first appended sample, OpenAI's audio_start_ms / audio_end_ms)."""

    def __init__(self, max_seconds: float):
        self.max_samples = int(max_seconds * INPUT_SAMPLE_RATE)
        self.carry = np.zeros(0, np.float32)  # 24 kHz samples short of a whole triple
        self.chunks: list[np.ndarray] = []
        self.start = 0  # session-timeline 16 kHz sample of the buffer's first sample
        self.size = 0

    @property
    def end_ms(self) -> int:
        return (self.start + self.size) * 1000 // INPUT_SAMPLE_RATE

    @property
    def duration_ms(self) -> int:
        return self.size * 1000 // INPUT_SAMPLE_RATE

    def append(self, audio_24k: np.ndarray) -> np.ndarray:
        """Add client samples; the new 16 kHz samples."""
        audio = np.concatenate([self.carry, audio_24k])
        whole = audio.size - audio.size % 3
        self.carry = audio[whole:]
        converted = _triples_to_16k(audio[:whole])
        if self.size + converted.size > self.max_samples:
            raise ApiError(400, f"input_audio_buffer holds more than {self.max_samples // INPUT_SAMPLE_RATE} s of "
                                "audio: commit or clear it", param="audio", code="input_audio_buffer_full")
        self.chunks.append(converted)
        self.size += converted.size
        return converted

    def take(self, from_ms: int | None = None) -> np.ndarray:
        """The buffered audio (from ``from_ms`` of the session timeline when given), emptying the buffer."""
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        if from_ms is not None:
            audio = audio[max(0, from_ms * INPUT_SAMPLE_RATE // 1000 - self.start):]
        self.clear()
        return audio

    def keep_last(self, ms: int) -> None:
        """Drop all but the last ``ms`` (silence the VAD heard: only the speech's prefix padding is kept)."""
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        keep = min(audio.size, ms * INPUT_SAMPLE_RATE // 1000)
        self.start += audio.size - keep
        self.chunks, self.size = [audio[audio.size - keep:]], keep

    def clear(self) -> None:
        self.start += self.size
        self.chunks, self.size = [], 0


def _triples_to_16k(audio: np.ndarray) -> np.ndarray:
    return resample(audio, CLIENT_RATE, INPUT_SAMPLE_RATE) if audio.size else np.zeros(0, np.float32)
