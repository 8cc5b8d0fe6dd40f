"""The fixed benchmark workload (benchmarks/README.md, Metrics): every request has the same prompt length, thinker
token count and audio length, forced with IGNORE_EOS + MIN/MAX, so runs on different systems compare."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

# Plain words: any tokenizer splits them into ordinary tokens (no special or multi-line tokens).
PROMPT_WORDS = ("please tell me a calm story about a small boat that sails across a quiet lake at dawn while "
                "the birds wake up and the wind carries the smell of pine trees over the water").split()


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 100      # tokens of the user text (the chat template adds its own few)
    thinker_tokens: int = 100     # thinker new tokens, exact (IGNORE_EOS, MIN = MAX)
    audio_frames: int = 250       # talker frames, exact; 12.5 frames per second: 250 = 20 s of audio
    concurrencies: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    requests_per_level: int | None = None  # None: 2 x concurrency, at least 4
    warmup_requests: int = 2
    seed: int = 1234

    def __post_init__(self):
        for name in ("prompt_tokens", "thinker_tokens", "audio_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError(f"requests_per_level must be >= 1, got {self.requests_per_level}")

    def requests_at(self, concurrency: int) -> int:
        return self.requests_per_level or max(4, 2 * concurrency)


FULL = Workload()
# CPU / CI: a tiny checkpoint answers in well under a second per request at these lengths.
QUICK = Workload(prompt_tokens=16, thinker_tokens=16, audio_frames=25, concurrencies=(1, 2, 4), warmup_requests=1)
PRESETS = {"full": FULL, "quick": QUICK}


def with_overrides(base: Workload, **overrides) -> Workload:
    """``base`` with every override that is not None."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def prompt_text(num_tokens: int, tokenizer_path: str | Path | None = None) -> str:
    """User text of ``num_tokens`` tokens under the checkpoint's tokenizer (as close as whole words allow);
    without a tokenizer, ``num_tokens`` words."""
    words = [PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(num_tokens)]
    if tokenizer_path is None:
        return " ".join(words)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def count(n_words: int) -> int:
        return len(tokenizer.encode(" ".join(words[:n_words]), add_special_tokens=False).ids)

    # Most words that still fit: a word is at least one token, so n_words <= num_tokens.
    low, high = 1, num_tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if count(middle) <= num_tokens else (low, middle - 1)
    return " ".join(words[:low])


def client_tensors(workload: Workload, text: str, *, sequential: bool = False) -> dict[str, np.ndarray]:
    """The ``omni`` model's client tensors for one benchmark request (greedy, fixed lengths)."""
    return {
        "TEXT": np.array([text.encode("utf-8")], dtype=np.object_),
        "MAX_TOKENS": np.array([workload.thinker_tokens], np.int32),
        "MIN_TOKENS": np.array([workload.thinker_tokens], np.int32),
        "IGNORE_EOS": np.array([True]),
        "MAX_AUDIO_FRAMES": np.array([workload.audio_frames], np.int32),
        "MIN_AUDIO_FRAMES": np.array([workload.audio_frames], np.int32),
        "TEMPERATURE": np.array([0.0], np.float32),
        "SEED": np.array([workload.seed], np.int64),
        "SEQUENTIAL": np.array([sequential]),
    }
