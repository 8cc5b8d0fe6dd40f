"""Server VAD: silero-vad's speech probability per 32 ms of 16 kHz audio (its ONNX model, shipped in the wheel,
run by onnxruntime: nothing is downloaded at run time), turned into speech started / stopped with OpenAI's
``server_vad`` settings (threshold, prefix padding, silence duration).

The model is stateful (a recurrent state per stream), so every session has its own detector. ``feed`` is
blocking CPU work (~0.3 ms a window): the connection calls it in an executor, off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
WINDOW = 512  # samples per model call at 16 kHz (32 ms): the only size silero-vad takes at this rate
# Speech goes on until the probability drops this far below the threshold (silero's own VADIterator hysteresis),
# so one soft syllable does not end a turn.
HYSTERESIS = 0.15


def _load_model():
    import torch

    threads = torch.get_num_threads()
    import silero_vad  # its import sets torch's thread count to 1 for the whole process: put it back

    torch.set_num_threads(threads)
    return silero_vad.load_silero_vad(onnx=True)


@dataclass(frozen=True)
class VadSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True)
class SpeechEvent:
    """``started`` or ``stopped`` at ``ms`` of the session's input audio (for ``started``: the speech's onset
    less the prefix padding, as OpenAI's audio_start_ms)."""

    kind: str
    ms: int


class SpeechDetector:
    def __init__(self, settings: VadSettings):
        self.settings = settings
        self.model = _load_model()
        self.pending = np.zeros(0, np.float32)
        self.samples_seen = 0  # 16 kHz samples given to the model so far
        self.speaking = False
        self.silence_since: int | None = None  # sample where the current silence began, while speaking

    def feed(self, audio: np.ndarray) -> list[SpeechEvent]:
        """Take the next 16 kHz float samples; the turn boundaries they complete."""
        import torch

        self.pending = np.concatenate([self.pending, np.asarray(audio, np.float32)])
        events = []
        while self.pending.size >= WINDOW:
            window, self.pending = self.pending[:WINDOW], self.pending[WINDOW:]
            probability = float(self.model(torch.from_numpy(window.copy()), SAMPLE_RATE))
            event = self._step(probability)
            self.samples_seen += WINDOW
            if event is not None:
                events.append(event)
        return events

    def _step(self, probability: float) -> SpeechEvent | None:
        start = self.samples_seen
        if not self.speaking:
            if probability >= self.settings.threshold:
                self.speaking, self.silence_since = True, None
                onset_ms = start * 1000 // SAMPLE_RATE
                return SpeechEvent("started", max(0, onset_ms - self.settings.prefix_padding_ms))
            return None
        if probability >= self.settings.threshold:
            self.silence_since = None
        elif probability < self.settings.threshold - HYSTERESIS and self.silence_since is None:
            self.silence_since = start
        if self.silence_since is not None:
            silent_ms = (start + WINDOW - self.silence_since) * 1000 // SAMPLE_RATE
            if silent_ms >= self.settings.silence_duration_ms:
                self.speaking = False
                return SpeechEvent("stopped", self.silence_since * 1000 // SAMPLE_RATE)
        return None
