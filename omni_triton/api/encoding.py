"""Wire formats: 16-bit PCM at 24 kHz, WAV (whole, or a header for a stream of unknown length), SSE events."""

from __future__ import annotations

import io
import json
import struct

import numpy as np

from omni_triton.client import OUTPUT_SAMPLE_RATE, to_pcm16, write_wav

# One codec frame decodes to this many 24 kHz samples (12.5 frames per second).
SAMPLES_PER_FRAME = 1920
STREAMED_WAV_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a stream: "unknown", as streaming encoders write them


def pcm16_bytes(audio: np.ndarray) -> bytes:
    return to_pcm16(audio).tobytes()


def wav_bytes(audio: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    write_wav(buffer, audio)
    return buffer.getvalue()


def streamed_wav_header(sample_rate: int = OUTPUT_SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown", to put before PCM sent as it is made."""
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (struct.pack("<4sI4s", b"RIFF", STREAMED_WAV_SIZE, b"WAVE") + fmt
            + struct.pack("<4sI", b"data", STREAMED_WAV_SIZE))


def audio_frames(num_samples: int) -> int:
    """Codec frames (audio tokens) behind ``num_samples`` of output audio."""
    return -(-num_samples // SAMPLES_PER_FRAME)


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
