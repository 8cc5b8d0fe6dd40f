"""Stand-ins for a Session's audio stream and detokenizer in CPU tests of the orchestrator's session (no server)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer

# what a session says when the code2wav stage died under it (the stage supervisor's verdict)
DEATH = "code2wav stage failed: its process exited while serving this request; retry it"


@dataclass
class Job:
    codes: torch.Tensor
    context_frames: int = 0
    start_frame: int = 0
    new_frames: int = 1


class OneJob:
    """An audio stream that makes one decode job of the first frames it gets."""

    policy = ChunkPolicy()  # left context: the session closes no vocoder stream

    def __init__(self):
        self.frames: list[torch.Tensor] = []

    def append(self, frames):
        self.frames.append(frames)

    def next_job(self, final):
        return Job(self.frames.pop(0).T) if self.frames else None


def word_detokenizer() -> IncrementalDetokenizer:
    """A detokenizer of four words, w0..w3."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return IncrementalDetokenizer(tokenizer)
