"""One request's state inside the engine.

Positions ("tokens") are counted uniformly for both stages: position ``p`` has an *input* (a token id
for the thinker, an input embedding for the talker) once ``p < num_inputs``; its K/V is in the cache once
``p < num_computed_tokens``. A step computes positions ``[num_computed_tokens, num_inputs)`` (chunked), and
a token is sampled when the computed prefix reaches the last input and that input's successor has not
been sampled yet. How an input is turned into an embedding is the stage's business (``stage.py``).
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import numpy as np
import torch

from omni_triton.engine.sampling import SampleRow, SamplingParams, make_generator


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission; holds no blocks
    RUNNING = "running"  # holds blocks, has inputs to compute
    WAITING_FOR_INPUT = "waiting_for_input"  # holds blocks, next input not supplied yet (talker)
    FINISHED = "finished"


_arrival = itertools.count()


class Sequence:
    def __init__(self, request_id: str, sampling_params: SamplingParams, *, num_prompt_positions: int,
                 prompt_token_ids: list[int] | None = None, prompt_positions: torch.Tensor | None = None,
                 device: torch.device | str = "cpu"):
        if num_prompt_positions < 1:
            raise ValueError(f"request {request_id!r}: prompt must have >= 1 position, got {num_prompt_positions}")
        if prompt_positions is not None and tuple(prompt_positions.shape) != (3, num_prompt_positions):
            raise ValueError(f"request {request_id!r}: prompt_positions shape {tuple(prompt_positions.shape)}, "
                             f"expected (3, {num_prompt_positions})")
        self.request_id = request_id
        self.arrival = next(_arrival)  # admission order; "newest" for preemption
        self.params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_prompt_positions = num_prompt_positions
        self.prompt_token_ids = list(prompt_token_ids or [])  # repetition-penalty history (thinker only)
        self.output_token_ids: list[int] = []
        self.num_inputs = num_prompt_positions
        self.num_computed_tokens = 0
        self.num_emitted_positions = 0  # captured states already streamed out (recompute must not repeat them)
        self.block_table: list[int] = []
        # prefix caching (``prefix_cache``): 16-byte keys of the prompt positions' inputs (None: not cached),
        # whether generated positions are keyed by their token ids, the hashes of the leading full blocks,
        # the leading blocks offered to the cache, the positions taken from it at the last admission, and the
        # prompt positions whose kept states are stored beside the blocks
        self.cache_keys: bytes | None = None
        self.keys_follow_tokens = False
        self.block_hashes: list[bytes] = []
        self.num_named_blocks = 0
        self.num_cached_tokens = 0
        self.states_through = 0
        self.finish_reason: str | None = None
        self.stage_state: Any = None  # owned by the stage adapter
        self.sample_row = SampleRow(sampling_params, make_generator(sampling_params.seed, device),
                                    seen_ids=set(self.prompt_token_ids))
        # M-RoPE: explicit positions for the prompt, then text positions continuing after its max
        self._prompt_positions = prompt_positions.long().cpu() if prompt_positions is not None else None
        # rope position - position, wherever the prompt's positions are not given explicitly
        self.rope_delta = 0 if prompt_positions is None else int(prompt_positions.max()) + 1 - num_prompt_positions

    # -- counters -------------------------------------------------------------------------------------------
    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Positions with an input but no K/V yet."""
        return self.num_inputs - self.num_computed_tokens

    def samples_after(self, end: int) -> bool:
        """Whether computing up to position ``end`` yields a new token (not a recompute of an old one)."""
        return end == self.num_inputs and self.num_prompt_positions + self.num_generated == self.num_inputs

    @property
    def has_prompt_positions(self) -> bool:
        """Whether the prompt's rope positions were given (M-RoPE), not ``position + rope_delta``."""
        return self._prompt_positions is not None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    # -- updates --------------------------------------------------------------------------------------------
    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.sample_row.record(token_id)

    def check_stop(self, token_id: int) -> str | None:
        p = self.params
        if not p.ignore_eos and token_id in p.stop_token_ids and self.num_generated >= p.min_new_tokens:
            return "stop"
        if self.num_generated >= p.max_new_tokens:
            return "length"
        return None

    def append_token(self, token_id: int) -> str | None:
        """``append_output`` then ``check_stop``, in one call: the engine's finish does it for every row of every
        step (``record`` and the counter inlined)."""
        outputs = self.output_token_ids
        outputs.append(token_id)
        row = self.sample_row
        row.seen_ids.add(token_id)
        row.num_generated += 1
        p = self.params
        generated = len(outputs)
        if not p.ignore_eos and token_id in p.stop_token_ids and generated >= p.min_new_tokens:
            return "stop"
        if generated >= p.max_new_tokens:
            return "length"
        return None

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = self.num_cached_tokens = self.states_through = self.num_named_blocks = 0
        self.block_table = []

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions (t/h/w rows) of positions start..end-1."""
        pos = torch.arange(start, end, dtype=torch.long) + self.rope_delta
        pos = pos.expand(3, -1).clone()
        if self._prompt_positions is not None and start < self.num_prompt_positions:
            stop = min(end, self.num_prompt_positions)
            pos[:, :stop - start] = self._prompt_positions[:, start:stop]
        return pos

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, inputs={self.num_inputs}, "
                f"computed={self.num_computed_tokens}, generated={self.num_generated}, blocks={len(self.block_table)})")


def chunk_positions(chunks) -> torch.Tensor:
    """[3, sum of end - start] rope positions of a step's chunks ``(seq, start, end)``, as ``Sequence.positions``
    of each, concatenated, in one numpy pass: a step with prefill rows is not launched ahead, so its host time is
    the GPU's idle time (the talker's such steps spent ~3 ms of it in per-chunk ``positions`` at 64 streams).
    Explicit prompt positions (M-RoPE prompts) are written over their columns."""
    lengths = np.fromiter((end - start for _, start, end in chunks), dtype=np.int64, count=len(chunks))
    firsts = np.fromiter((start + seq.rope_delta for seq, start, _ in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.cumsum(lengths) - lengths
    row = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(firsts - offsets, lengths)
    positions = np.repeat(row[None], 3, axis=0)
    for (seq, start, end), offset in zip(chunks, offsets.tolist()):
        if seq.has_prompt_positions and start < seq.num_prompt_positions:
            positions[:, offset:offset + end - start] = seq.positions(start, end).numpy()
    return torch.from_numpy(positions)
