"""Streamed states kept beside the KV blocks, for prompt positions a later request takes from the prefix cache.

A stage that streams per-position states (the thinker: each position's input embedding and its hidden state after
``accept_hidden_layer`` layers, what the talker is conditioned on) must stream them for cached positions too,
which it does not compute. Those it can make from the inputs alone it recomputes (``stage.recompute_states``: the
thinker's input embeddings are a table lookup, or the request's own audio rows); the others
(``stage.kept_states``: the accept-layer hidden states) are written here per KV slot as prompt positions are
computed, so they live and die with their block: a block named in the cache carries them
(``BlockManager.has_states``), an evicted one is overwritten with its next owner's.
"""

from __future__ import annotations

import torch

from omni_triton.engine.block_manager import kv_slots
from omni_triton.engine.handoff import to_device_async
from omni_triton.engine.sequence import Sequence


class KeptStates:
    def __init__(self, dims: dict[str, int], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        self.pools = {name: torch.zeros(num_blocks * block_size, dim, dtype=dtype, device=device)
                      for name, dim in dims.items()}

    @property
    def nbytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self.pools.values())

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        # (a pinned copy: the host does not wait for the steps queued on the stream)
        return to_device_async(torch.from_numpy(kv_slots(seq.block_table, start, end, self.block_size)), self.device)

    def store(self, seq: Sequence, start: int, rows: dict[str, torch.Tensor]) -> None:
        """``rows``: the kept states of positions start.. of seq (their blocks are seq's)."""
        end = start + next(iter(rows.values())).shape[0]
        slots = self._slots(seq, start, end)
        for name, pool in self.pools.items():
            pool.index_copy_(0, slots, rows[name].to(pool.dtype))

    def load(self, seq: Sequence, start: int, end: int) -> dict[str, torch.Tensor]:
        slots = self._slots(seq, start, end)
        return {name: pool.index_select(0, slots) for name, pool in self.pools.items()}
