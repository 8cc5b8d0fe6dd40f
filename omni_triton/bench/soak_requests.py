"""The soak's request mix (issue 48): seeded draws of thinker tokens and audio frames from ranges, spoken or text
input, several speakers; a fraction cancelled by the client mid-stream, a fraction with a ``deadline_s`` meant to
expire. And the worker that sends one such request on its stream and records what its client saw.

Every request is fixed-length (IGNORE_EOS, MIN = MAX), as the bench's fixed workload is: what it costs the server
is what was drawn, whatever the random weights say. A request meant to expire asks for the ranges' longest output,
so its deadline falls mid-stream.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners.triton_stream import TritonStreamWorker
from omni_triton.bench.workload import PROMPT_WORDS
from omni_triton.client import INPUT_SAMPLE_RATE, OmniStreamClient

COMPLETE, CANCEL, DEADLINE = "complete", "cancel", "deadline"  # what a request is meant to end with
MEANT_CODES = {COMPLETE: None, CANCEL: "CANCELLED", DEADLINE: "DEADLINE_EXCEEDED"}  # the error code each ends with
DEFAULT_SPEAKERS = ("chelsie", "ethan", "aiden")
# A cancelled request is cancelled after this many audio chunks (drawn): mid-stream, not always at the first.
CANCEL_AFTER_CHUNKS = (1, 3)


@dataclass(frozen=True)
class SoakRequest:
    index: int
    text: str
    audio_in: np.ndarray | None  # 16 kHz speech stand-in, or None for text input
    speaker: str
    thinker_tokens: int
    audio_frames: int
    fate: str                    # COMPLETE, CANCEL or DEADLINE
    cancel_after_chunks: int     # CANCEL: the client cancels once this many audio chunks arrived
    deadline_s: float | None     # DEADLINE: the request's deadline_s parameter
    seed: int

    def scalars(self) -> dict:
        return dict(max_tokens=self.thinker_tokens, min_tokens=self.thinker_tokens, ignore_eos=True,
                    max_audio_frames=self.audio_frames, min_audio_frames=self.audio_frames, speaker=self.speaker,
                    seed=self.seed)


@dataclass(frozen=True)
class RequestMix:
    thinker_tokens: tuple[int, int] = (10, 400)
    audio_frames: tuple[int, int] = (25, 500)
    spoken_fraction: float = 0.5
    spoken_seconds: tuple[float, float] = (1.0, 3.0)
    speakers: tuple[str, ...] = DEFAULT_SPEAKERS
    cancel_fraction: float = 0.10
    deadline_fraction: float = 0.05
    deadline_s: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for name in ("thinker_tokens", "audio_frames", "spoken_seconds"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name} must be a range 0 < low <= high, got {low}-{high}")
        for name in ("spoken_fraction", "cancel_fraction", "deadline_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.cancel_fraction + self.deadline_fraction > 1:
            raise ValueError("cancel_fraction + deadline_fraction must be <= 1")
        if self.deadline_s <= 0 or not self.speakers:
            raise ValueError(f"deadline_s must be > 0 and speakers not empty, got {self.deadline_s}, {self.speakers}")

    def draw(self, count: int, first_index: int = 0) -> list[SoakRequest]:
        """``count`` requests, the same for the same seed and index (a later phase draws from its own index on)."""
        return [self._one(index) for index in range(first_index, first_index + count)]

    def _one(self, index: int) -> SoakRequest:
        rng = np.random.default_rng([self.seed, index])
        fate_draw = rng.random()
        fate = (CANCEL if fate_draw < self.cancel_fraction
                else DEADLINE if fate_draw < self.cancel_fraction + self.deadline_fraction else COMPLETE)
        tokens = int(rng.integers(self.thinker_tokens[0], self.thinker_tokens[1] + 1))
        frames = int(rng.integers(self.audio_frames[0], self.audio_frames[1] + 1))
        if fate == DEADLINE:
            tokens, frames = self.thinker_tokens[1], self.audio_frames[1]
        words = [PROMPT_WORDS[(index + k) % len(PROMPT_WORDS)] for k in range(int(rng.integers(4, 24)))]
        spoken = rng.random() < self.spoken_fraction
        audio_in = speech_stand_in(rng, float(rng.uniform(*self.spoken_seconds))) if spoken else None
        return SoakRequest(index=index, text=f"Request {index}: " + " ".join(words), audio_in=audio_in,
                           speaker=self.speakers[int(rng.integers(len(self.speakers)))], thinker_tokens=tokens,
                           audio_frames=frames, fate=fate,
                           cancel_after_chunks=int(rng.integers(CANCEL_AFTER_CHUNKS[0], CANCEL_AFTER_CHUNKS[1] + 1)),
                           deadline_s=self.deadline_s if fate == DEADLINE else None, seed=int(rng.integers(2 ** 31)))

    def describe(self) -> dict:
        return {"thinker_tokens": list(self.thinker_tokens), "audio_frames": list(self.audio_frames),
                "spoken_fraction": self.spoken_fraction, "spoken_seconds": list(self.spoken_seconds),
                "speakers": list(self.speakers), "cancel_fraction": self.cancel_fraction,
                "deadline_fraction": self.deadline_fraction, "deadline_s": self.deadline_s, "seed": self.seed}


def speech_stand_in(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """Voiced-speech-like 16 kHz audio: a gliding pitch with harmonics, syllable-rate loudness, a little noise.
    The served audio encoder sees a spoken input's shape and length; no recording is shipped."""
    t = np.arange(int(seconds * INPUT_SAMPLE_RATE)) / INPUT_SAMPLE_RATE
    pitch = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(pitch) / INPUT_SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    syllables = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(3, 5) * t))
    audio = 0.2 * voiced * syllables + 0.01 * rng.standard_normal(t.size)
    return audio.astype(np.float32)


def speakers_of(checkpoint: Path | None) -> tuple[str, ...]:
    """The checkpoint's speaker names (its talker config), else the released model's."""
    config = checkpoint / "config.json" if checkpoint is not None else None
    if config is None or not config.is_file():
        return DEFAULT_SPEAKERS
    names = json.loads(config.read_text()).get("talker_config", {}).get("speaker_id", {})
    return tuple(sorted(names)) or DEFAULT_SPEAKERS


@dataclass
class SoakTiming(RequestTiming):
    """A RequestTiming with what the soak needs beside it: which request, what it was meant to end with, when it
    was sent (seconds on the run's clock) and whether the client's cancel went out."""

    index: int = -1
    fate: str = COMPLETE
    sent_at: float = 0.0
    cancel_sent: bool = False
    extra: dict = field(default_factory=dict)


def fate_of(timing: RequestTiming) -> str:
    """What a request was meant to end with; a timing without a fate (a bare RequestTiming) was meant to complete."""
    return getattr(timing, "fate", COMPLETE)


def ended_as_meant(timing: RequestTiming) -> bool:
    """Whether a request ended as it may: completed, or failed with its fate's code (a cancel sent first)."""
    if timing.ok:
        return True
    fate = fate_of(timing)
    if fate == CANCEL and not getattr(timing, "cancel_sent", False):
        return False
    return MEANT_CODES[fate] is not None and timing.error_code == MEANT_CODES[fate]


class SoakWorker(TritonStreamWorker):
    """One gRPC stream; ``request`` sends a SoakRequest on it, times it, and cancels it mid-stream when that is its
    fate. Fits the open loop's stream pool (bench.open_loop.StreamPool) as a worker."""

    def __init__(self, url: str, clock_zero: float, timeout_s: float):
        super().__init__(OmniStreamClient(url), timeout_s)
        self.clock_zero = clock_zero

    def request(self, request: SoakRequest) -> SoakTiming:
        timing = SoakTiming(index=request.index, fate=request.fate, sent_at=time.perf_counter() - self.clock_zero)

        def after_chunk() -> None:
            if request.fate == CANCEL and len(timing.audio_chunks) == request.cancel_after_chunks:
                timing.cancel_sent = True
                self.client.cancel()

        return self.stream_timed(timing, request.text, request.audio_in, after_chunk, deadline_s=request.deadline_s,
                                 **request.scalars())


class SoakRunner:
    """Opens SoakWorkers (the open loop's ``Runner``): every worker's clock starts at ``clock_zero``."""

    name = "server"
    sequential = False
    max_concurrency = None

    def __init__(self, url: str, clock_zero: float, timeout_s: float = 600.0):
        self.url, self.clock_zero, self.timeout_s = url, clock_zero, timeout_s

    def open_worker(self) -> SoakWorker:
        return SoakWorker(self.url, self.clock_zero, self.timeout_s)

    def close(self) -> None:
        pass
