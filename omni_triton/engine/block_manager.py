"""Fixed-size KV blocks: a free list, per-sequence block tables and (optionally) prefix caching."""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
import torch

from omni_triton.engine.prefix_cache import block_hashes
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
    """Hands out KV blocks. With ``prefix_caching``, a computed full block is also named by its content's hash
    (``prefix_cache.block_hashes``): a request admitted later takes the longest run of named blocks its inputs
    begin with instead of computing them (shared, reference-counted); a named block nobody holds stays named
    until a request needs a block and no unnamed one is free, then the least recently used goes (evicted).

    ``blocks_keep_states``: the stage streams per-position states that are kept beside the blocks (the thinker's
    accept-layer hidden states, ``kept_states.KeptStates``); a block carries them when every position in it was a
    prompt position whose states were stored, and a request that still has states to stream takes only such
    blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 blocks_keep_states: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks_keep_states = blocks_keep_states
        self.free_blocks: deque[int] = deque(range(num_blocks))  # unnamed and unheld
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.has_states = [False] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named, unheld: least recently used first
        self.num_evictions = 0
        self.num_query_tokens = 0  # inputs of every admission (a recompute's too), and of those, the ones cached
        self.num_hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can take: unheld, named or not."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

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
        seq.block_table.extend(self._take() for _ in range(needed))

    def allocate_next_positions(self, seqs: list[Sequence]) -> bool:
        """One more position after the computed ones for each of ``seqs`` (a decode step's rows): the blocks
        those whose tables are full need, taken for all of them, or none and False when too few are free."""
        full = [seq for seq in seqs if seq.num_computed_tokens >= len(seq.block_table) * self.block_size]
        if len(full) > self.num_free:
            return False
        for seq in full:
            seq.block_table.append(self._take())
        return True

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq, 1)

    def append_slot(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def free(self, seq: Sequence) -> None:
        """seq finished, was aborted or preempted: its computed blocks are named first (kept for later requests),
        then released; the tail goes first to the LRU end, so a prefix outlives its continuations."""
        self.name_computed_blocks(seq)
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and self.block_hash[block] is None:
                self.free_blocks.append(block)
        for block in reversed(seq.block_table):
            if self.ref_counts[block] == 0 and self.block_hash[block] is not None:
                self.evictable[block] = None
        seq.block_table = []

    # -- prefix caching -------------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The named blocks ``seq``'s inputs begin with (none without prefix caching or once seq computed
        anything), short of its last input: that one is computed, so the step samples."""
        if not self.prefix_caching or seq.num_computed_tokens or seq.cache_keys is None:
            return []
        limit = (seq.num_inputs - 1) // self.block_size
        hashes = block_hashes(seq, self.block_size)[:limit]
        blocks = []
        for index, content in enumerate(hashes):
            block = self.cached.get(content)
            if block is None:
                break
            if ((index + 1) * self.block_size > seq.num_emitted_positions and self.blocks_keep_states
                    and not self.has_states[block]):
                break  # its streamed states are not kept: computing it streams them
            blocks.append(block)
        return blocks

    def num_free_after_taking(self, blocks: list[int]) -> int:
        return self.num_free - sum(self.ref_counts[block] == 0 for block in blocks)

    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Admit seq over ``blocks`` (``cached_prefix``): they are its first blocks, computed."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = list(blocks)
        seq.num_named_blocks = len(blocks)
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.block_size
        seq.states_through = max(seq.states_through, seq.num_cached_tokens)
        if self.prefix_caching:
            self.num_query_tokens += seq.num_inputs
            self.num_hit_tokens += seq.num_cached_tokens

    def name_computed_blocks(self, seq: Sequence) -> None:
        """Name seq's computed full blocks whose inputs are known. A block whose content is named already keeps
        that name, unless this one carries streamed states and that one does not."""
        size = self.block_size
        if (not self.prefix_caching or seq.cache_keys is None
                or seq.num_computed_tokens // size <= seq.num_named_blocks):
            return
        hashes = block_hashes(seq, size)
        first = seq.num_named_blocks
        seq.num_named_blocks = min(seq.num_computed_tokens // size, len(hashes), len(seq.block_table))
        for index in range(first, seq.num_named_blocks):
            block, content = seq.block_table[index], hashes[index]
            if self.block_hash[block] is not None:
                continue  # taken cached
            with_states = self.blocks_keep_states and (index + 1) * size <= seq.states_through
            named = self.cached.get(content)
            if named is not None and (self.has_states[named] or not with_states):
                continue
            if named is not None:
                self._unname(named)
            self.cached[content] = block
            self.block_hash[block] = content
            self.has_states[block] = with_states

    def _unname(self, block: int) -> None:
        self._forget(block)
        if block in self.evictable:
            del self.evictable[block]
            self.free_blocks.append(block)

    def _forget(self, block: int) -> None:
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None
        self.has_states[block] = False

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # every unheld block is named: the least recently used goes
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block
