"""The code2wav stage's open audio streams: each one's streaming-vocoder state, kept on the vocoder's device.

A stream's chunks carry new frames only (``ChunkPolicy(stateful=True)``); the state that makes their samples
equal a one-pass decode (``omni_triton/models/code2wav/stateful.py``) stays here between calls, keyed by the
stream's id. The state lives in slots of preallocated tensors, one slot per open stream; a call gathers its
streams' slots (``index_select``), decodes every chunk in one batched call and writes the new state back
(``index_copy_``): on a GPU nothing crosses to the host but the slot indices and lengths (a few ints).

Lifetime: a stream opens with its first chunk (``first``), and is freed by ``close`` (its last chunk was sent, or
the request was cancelled or failed), by ``evict_idle`` (its orchestrator vanished without closing: past
``idle_timeout_s`` without a chunk), or with the stage's process. A chunk for a stream this stage does not hold,
or a first chunk for one it already holds, is a ValueError naming the stream, never audio from a wrong state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from omni_triton.engine.handoff import to_device_async
from omni_triton.models.code2wav.stateful import StateSpec

DEFAULT_IDLE_TIMEOUT_S = 600.0  # far beyond any gap between one request's chunks


@dataclass
class StreamChunk:
    stream_id: str
    codes: torch.Tensor  # [G, n] new frames, n >= 1
    first: bool  # opens the stream


class Code2WavStreamStates:
    """``decode_stream``: a Code2WavRuntime's (codes, lengths, state) -> (waveform, state)."""

    def __init__(self, decode_stream: Callable, specs: list[StateSpec], new_samples: Callable[[int, int], int],
                 device: torch.device, *, initial_slots: int = 8, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self._decode_stream = decode_stream
        self._specs = specs
        self._new_samples = new_samples  # (frames decoded, new frames) -> samples out
        self.device = device
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._tensors = [torch.zeros(initial_slots, *spec.shape, dtype=spec.dtype, device=device) for spec in specs]
        self._free = list(range(initial_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self._frames: dict[str, int] = {}  # frames decoded per stream (host bookkeeping: sample counts)
        self._last_used: dict[str, float] = {}

    @property
    def open_streams(self) -> int:
        return len(self._slots)

    @property
    def capacity(self) -> int:
        return self._tensors[0].shape[0]

    def decode(self, chunks: list[StreamChunk]) -> list[torch.Tensor | ValueError]:
        """Each chunk's new samples ([S] on the device), or the ValueError that rejected it; the accepted
        chunks are decoded in one call, right-padded to the longest."""
        results: list[torch.Tensor | ValueError | None] = [None] * len(chunks)
        accepted: list[int] = []
        claimed: set[str] = set()
        for index, chunk in enumerate(chunks):
            try:
                self._check(chunk, claimed)
            except ValueError as error:
                results[index] = error
                continue
            claimed.add(chunk.stream_id)
            accepted.append(index)
        if accepted:
            for index, samples in zip(accepted, self._decode_accepted([chunks[i] for i in accepted])):
                results[index] = samples
        return results

    def close(self, stream_id: str) -> bool:
        """Free the stream's slot; False when this stage does not hold it (never opened, or already freed)."""
        slot = self._slots.pop(stream_id, None)
        if slot is None:
            return False
        del self._frames[stream_id], self._last_used[stream_id]
        self._free.append(slot)
        return True

    def evict_idle(self) -> list[str]:
        """Close the streams without a chunk for ``idle_timeout_s``; returns their ids."""
        now = self._clock()
        idle = [sid for sid, used in self._last_used.items() if now - used > self.idle_timeout_s]
        for stream_id in idle:
            self.close(stream_id)
        return idle

    # ------------------------------------------------------------------------------------------------

    def _check(self, chunk: StreamChunk, claimed: set[str]) -> None:
        sid = chunk.stream_id
        if not sid:
            raise ValueError("STREAM_ID must be a non-empty stream id")
        if sid in claimed:
            raise ValueError(f"STREAM_ID {sid!r}: two chunks of one stream in one call (send the next chunk "
                             "after the previous one's audio came back)")
        if chunk.first and sid in self._slots:
            raise ValueError(f"STREAM_ID {sid!r} is already open in this code2wav stage (STREAM_START twice)")
        if not chunk.first and sid not in self._slots:
            raise ValueError(f"STREAM_ID {sid!r} is not a stream this code2wav stage holds: never started "
                             "(STREAM_START on its first chunk), already ended, idle past "
                             f"{self.idle_timeout_s:.0f} s, or the stage restarted and lost its state")
        if chunk.codes.dim() != 2 or chunk.codes.shape[1] < 1:
            raise ValueError(f"CODES of stream {sid!r} must be [G, n >= 1], got {tuple(chunk.codes.shape)}")

    def _decode_accepted(self, chunks: list[StreamChunk]) -> list[torch.Tensor]:
        for chunk in chunks:
            if chunk.first:
                self._open(chunk.stream_id)
        # host ints to the device without waiting for the calls queued before (to_device_async)
        slots = to_device_async(torch.tensor([self._slots[c.stream_id] for c in chunks]), self.device)
        lengths = [c.codes.shape[1] for c in chunks]
        longest = max(lengths)
        codes = torch.stack([torch.nn.functional.pad(c.codes.to(self.device), (0, longest - n))
                             for c, n in zip(chunks, lengths)])
        state = [tensor.index_select(0, slots) for tensor in self._tensors]
        try:
            waveform, new_state = self._decode_stream(codes, to_device_async(torch.tensor(lengths), self.device),
                                                      state)
        except BaseException:
            for chunk in chunks:  # a stream whose call failed has no trustworthy state left
                self.close(chunk.stream_id)
            raise
        for tensor, new in zip(self._tensors, new_state):
            tensor.index_copy_(0, slots, new.to(tensor.dtype))
        now, samples = self._clock(), []
        for row, (chunk, n) in enumerate(zip(chunks, lengths)):
            samples.append(waveform[row, :self._new_samples(self._frames[chunk.stream_id], n)])
            self._frames[chunk.stream_id] += n
            self._last_used[chunk.stream_id] = now
        return samples

    def _open(self, stream_id: str) -> None:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        for tensor in self._tensors:
            tensor[slot].zero_()  # a fresh stream: zero left padding, positions 0
        self._slots[stream_id], self._frames[stream_id] = slot, 0
        self._last_used[stream_id] = self._clock()

    def _grow(self) -> None:
        """Twice the slots (a copy on the device, rare: capacity follows the most streams ever open at once)."""
        old = self.capacity
        self._tensors = [torch.cat([tensor, torch.zeros_like(tensor)]) for tensor in self._tensors]
        self._free = list(range(2 * old - 1, old - 1, -1))
