"""Streaming Code2Wav: decode codec frames chunk by chunk with left context only.

Each chunk decodes ``context + new`` frames in one stateless Code2Wav call (so any backend works: torch,
ONNX Runtime, a TensorRT engine) and keeps only the samples the previous chunks could not produce.

Sample bookkeeping. One pass over N frames gives ``N * spf - trim`` samples (spf = samples per frame,
1920; trim = 555 at full size) because the transposed convs look one step ahead. A chunk covering frames
[s, e) with c context frames therefore returns samples [s * spf - trim, e * spf - trim) of the one-pass
waveform (the first chunk, s = 0, returns [0, e * spf - trim)): every chunk after the first returns exactly
``new_frames * spf`` samples, and the concatenation has the one-pass length ``N * spf - trim``. The last
``trim`` samples are never produced, as in the one-pass decode. This needs c >= 1 after the first chunk.

Exactness. The new samples equal the one-pass ones when the context covers their receptive field:
``exact_left_context_frames(config)`` = ``num_hidden_layers * (sliding_window - 1)`` frames for the
pre-transformer + the conv stack's reach (10 frames at the released upsampling rates): 152 for the tiny
preset (2 layers), 81 for tiny-8g (1 layer), 578 for the released 8-layer model. In float64 that context
reproduces the one-pass samples to ~1e-12 and one frame less does not (tests/test_code2wav_stream.py).
Measured in fp32 on the tiny checkpoints (random codes, policy 4/25, whole-stream max abs error vs one
pass, waveform std 0.1-0.2, i.e. not clamped): exact context 1e-6 to 4e-5 (rounding of different call
shapes, scaled by the decoder's gain); tolerance used in the tests: 1e-4. Less context is not "nearly
exact" on random weights (attention is not local): 72-82 frames on the 2-layer tiny model give errors of
0.4-0.6, 25 frames ~1. Trained weights may be more forgiving, but nothing here measures that, so
``ChunkPolicy()`` defaults to the exact context (``left_context_frames=None``); a deployment may trade
exactness for compute with a smaller value (HF's ``chunked_decode`` uses 25) -- at full size the exact
context makes each 25-frame chunk a 603-frame decode.

Stateful. ``ChunkPolicy(stateful=True)``: chunks carry new frames only (``context_frames`` 0) and the code2wav
stage keeps each stream's vocoder state between them (``omni_triton/pipeline/code2wav/stream_states.py``): the
one-pass samples at the cost of the new frames (docs/code2wav_streaming.md).

Batching. ``StreamDecoder.decode`` runs the chunks of many streams in one call: shorter chunks are
right-padded to the longest. That is exact: the transformer is causal and every conv pads on the left,
so padding frames only change samples past each chunk's own ``frames * spf - trim``, which are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


STATEFUL, EXACT = "stateful", "exact"  # --left-context-frames settings besides a frame count


@dataclass(frozen=True)
class ChunkPolicy:
    first_chunk_frames: int = 4  # small first chunk: time-to-first-audio (4 frames = 320 ms of audio)
    # Later chunks: up to 2 s of audio per Code2Wav call. They ramp up to it (``chunk_size``): a 25-frame
    # second chunk had to be generated and decoded while the first one's 320 ms played, and at full size on
    # a GPU it missed that by a few ms at concurrency 1 (every stream underran once).
    chunk_frames: int = 25
    left_context_frames: int | None = None  # None: exact_left_context_frames of the model
    stateful: bool = False  # new frames only; the vocoder carries its state (left_context_frames unused)

    def __post_init__(self):
        for name in ("first_chunk_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChunkPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.left_context_frames is not None and self.left_context_frames < 1:
            raise ValueError("ChunkPolicy.left_context_frames must be >= 1 (a chunk needs one earlier frame to "
                             f"produce the samples its predecessor could not), got {self.left_context_frames}")

    @classmethod
    def from_setting(cls, first_chunk_frames: int, chunk_frames: int,
                     left_context: int | str | None) -> "ChunkPolicy":
        """The launch setting ``--left-context-frames``: ``stateful``, ``exact`` (or None) or a frame count."""
        if left_context == STATEFUL:
            return cls(first_chunk_frames, chunk_frames, stateful=True)
        if left_context in (EXACT, None):
            return cls(first_chunk_frames, chunk_frames)
        try:
            return cls(first_chunk_frames, chunk_frames, int(left_context))
        except ValueError:
            raise ValueError(f"left context {left_context!r} is not {STATEFUL!r}, {EXACT!r} or a frame count") from None

    def resolved(self, exact_left_context: int) -> "ChunkPolicy":
        if self.left_context_frames is not None or self.stateful:
            return self
        return ChunkPolicy(self.first_chunk_frames, self.chunk_frames, exact_left_context)

    def chunk_size(self, decoded_frames: int) -> int:
        """New frames in the chunk after ``decoded_frames``: the first chunk, then at most twice the audio
        already out (4, 8, 24, 25, ... with the defaults), so each chunk takes about as long to make as half
        the audio before it lasts, up to ``chunk_frames``."""
        if decoded_frames == 0:
            return self.first_chunk_frames
        return min(self.chunk_frames, 2 * decoded_frames)

    def ramp_sizes(self) -> tuple[int, ...]:
        """The new-frame counts of one stream's chunks along the ramp, first chunk first, each once (4, 8, 24,
        25 with the defaults): the chunk sizes most calls have."""
        sizes, decoded = [], 0
        while not sizes or sizes[-1] != self.chunk_frames:  # chunk_size doubles up to chunk_frames, then stays
            sizes.append(self.chunk_size(decoded))
            decoded += sizes[-1]
        return tuple(sizes)

    def max_frames_per_call(self) -> int:
        """Largest ``context + new`` frame count a decode call sees (engine profile maximum)."""
        if self.stateful:
            return max(self.first_chunk_frames, self.chunk_frames)
        if self.left_context_frames is None:
            raise ValueError("resolve left_context_frames first (ChunkPolicy.resolved)")
        return max(self.first_chunk_frames, self.left_context_frames + self.chunk_frames)


@dataclass
class ChunkJob:
    """One Code2Wav call's worth of one stream: ``codes`` [G, context_frames + new_frames]."""
    codes: torch.Tensor
    context_frames: int
    new_frames: int
    start_frame: int  # index of the first new frame in the stream
    # why it has this many new frames (``Code2WavStream``; traced): first, ramp (the policy's size),
    # deadline (the pacer cut it short lest the listener run dry), final (what was left at the stream's end)
    reason: str = ""

    @property
    def num_frames(self) -> int:
        return self.context_frames + self.new_frames

    @classmethod
    def after_context(cls, codes: torch.Tensor, context_frames: int) -> "ChunkJob":
        """A chunk whose first ``context_frames`` frames are left context (what a code2wav request carries).
        Only "first chunk or not" matters for the cut, and a chunk with context starts at frame >= context."""
        new_frames = codes.shape[-1] - context_frames
        return cls(codes, context_frames, new_frames, start_frame=context_frames)


class Code2WavStream:
    """One request's codec frames: collects them and hands out the next chunk to decode when it is due."""

    def __init__(self, policy: ChunkPolicy, num_quantizers: int, pacer: Any = None):
        """``pacer``: a ``chunk_pacing.ChunkPacer`` choosing chunk sizes from the stream's frame rate and the
        listener's buffer; None: the policy's fixed ramp."""
        if policy.left_context_frames is None and not policy.stateful:
            raise ValueError("Code2WavStream needs a resolved policy (ChunkPolicy.resolved(exact_left_context))")
        self.policy = policy
        self.pacer = pacer
        self.num_quantizers = num_quantizers
        self._pieces: list[torch.Tensor] = []  # [n, G] pieces not yet merged into the buffer
        self._buffer = torch.empty(0, num_quantizers, dtype=torch.long)
        self._buffer_start = 0  # stream index of _buffer[0]; older frames are no longer needed
        self.total_frames = 0
        self.decoded_frames = 0

    def append(self, frames: torch.Tensor) -> None:
        """frames [n, G] codec ids (a talker step's output; n may be 0)."""
        if frames.dim() != 2 or frames.shape[1] != self.num_quantizers:
            raise ValueError(f"frames must be [n, {self.num_quantizers}], got {tuple(frames.shape)}")
        if frames.shape[0]:
            self._pieces.append(frames)
            self.total_frames += frames.shape[0]

    @property
    def pending_frames(self) -> int:
        return self.total_frames - self.decoded_frames

    def next_job(self, final: bool = False) -> ChunkJob | None:
        """The next chunk if a full one is pending (or, when ``final``, whatever remains), else None.
        Marks its frames decoded: call until it returns None."""
        ramp = self.policy.chunk_size(self.decoded_frames)
        want = (ramp if self.pacer is None
                else self.pacer.chunk_size(self.decoded_frames, self.pending_frames, time.monotonic()))
        new = min(want, self.pending_frames)
        if new == 0 or (new < want and not final):
            return None
        reason = ("first" if self.decoded_frames == 0 else "ramp" if new == ramp
                  else "final" if new < want else "deadline")
        if self._pieces:
            self._buffer = torch.cat([self._buffer.to(self._pieces[0].device), *self._pieces])
            self._pieces = []
        start = self.decoded_frames
        context = 0 if self.policy.stateful else min(self.policy.left_context_frames, start)
        offset = self._buffer_start
        codes = self._buffer[start - context - offset:start + new - offset].T.contiguous()
        self.decoded_frames += new
        # frames older than the next chunk's left context are never read again
        keep_from = max(0, self.decoded_frames - (0 if self.policy.stateful else self.policy.left_context_frames))
        self._buffer = self._buffer[keep_from - offset:]
        self._buffer_start = keep_from
        return ChunkJob(codes, context, new, start, reason)


class StreamDecoder:
    """Decodes ChunkJobs of any number of streams with one batched Code2Wav call per ``decode``."""

    def __init__(self, decode_fn: Callable[[torch.Tensor], torch.Tensor], samples_per_frame: int, trim_samples: int):
        """decode_fn: codes LongTensor [B, G, N] -> waveform [B, N * samples_per_frame - trim_samples]."""
        if trim_samples >= samples_per_frame:
            raise ValueError(f"trim_samples={trim_samples} must be < samples_per_frame={samples_per_frame}")
        self.decode_fn = decode_fn
        self.samples_per_frame = samples_per_frame
        self.trim_samples = trim_samples

    def new_samples_range(self, job: ChunkJob) -> tuple[int, int]:
        """Slice of the chunk's decoded waveform that is new audio."""
        if job.start_frame > 0 and job.context_frames < 1:
            raise ValueError(f"chunk at frame {job.start_frame} has no left context; it needs >= 1 frame")
        end = job.num_frames * self.samples_per_frame - self.trim_samples
        begin = 0 if job.start_frame == 0 else job.context_frames * self.samples_per_frame - self.trim_samples
        return begin, end

    def decode(self, jobs: list[ChunkJob]) -> list[torch.Tensor]:
        """-> each job's new samples [S_i] (S_i = new_frames * spf, or minus trim for a stream's first chunk)."""
        if not jobs:
            return []
        longest = max(job.num_frames for job in jobs)
        codes = torch.stack([torch.nn.functional.pad(job.codes, (0, longest - job.num_frames)) for job in jobs])
        waveforms = self.decode_fn(codes)
        return [waveforms[i, slice(*self.new_samples_range(job))] for i, job in enumerate(jobs)]
