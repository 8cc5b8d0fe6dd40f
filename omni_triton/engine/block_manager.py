"""Fixed-size KV blocks: a free list and per-sequence block tables (no prefix sharing)."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from omni_triton.engine.sequence import Sequence


def kv_bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size  # 2 = K and V


def num_blocks_for_budget(budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> int:
    per_block = kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv budget {budget_bytes} bytes is below one block ({per_block} bytes)")
    return num_blocks


def kv_slots(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """The KV cache slots (block * block_size + offset, int64) of a sequence's positions start..end-1."""
    positions = np.arange(start, end)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks for seq to hold ``num_new_tokens`` more positions after its computed ones."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"request {seq.request_id!r} needs {needed} blocks, {self.num_free} free")
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(needed))

    def allocate_next_positions(self, seqs: list[Sequence]) -> bool:
        """One more position after the computed ones for each of ``seqs`` (a decode step's rows): the blocks
        those whose tables are full need, taken for all of them, or none and False when too few are free."""
        full = [seq for seq in seqs if seq.num_computed_tokens >= len(seq.block_table) * self.block_size]
        if len(full) > self.num_free:
            return False
        for seq in full:
            seq.block_table.append(self.free_blocks.popleft())
        return True

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq, 1)

    def append_slot(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
