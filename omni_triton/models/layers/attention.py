"""The one attention interface every causal model in the package goes through.

Models see a *flat varlen batch*: the new tokens of all sequences concatenated along dim 0
(prefill chunks and single decode tokens mixed). ``AttentionBatch`` knows, per sequence, which rows
are its tokens, how much context it already has in the paged KV cache, and where (slot) each new
token's K/V goes. A model layer calls ``batch.attend(layer_idx, q, k, v)``; it never sees blocks.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
a token at logical position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``, i.e. slot ``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    query_lens: list[int]  # new tokens per sequence, in batch order (host ints)
    context_lens: list[int]  # tokens in the KV cache per sequence after this step, new ones included
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token (where its next-token logits come from)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.slot_mapping.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> [T, Hq, D]. Writes k/v to the cache first."""
        cache = self.kv_caches[layer_idx]
        flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
        flat[0].index_copy_(0, self.slot_mapping, k.to(cache.dtype))
        flat[1].index_copy_(0, self.slot_mapping, v.to(cache.dtype))
        return attend_paged(q, cache, self, scale)


def attend_paged(q: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch, scale: float | None) -> torch.Tensor:
    """Reference path: per sequence, gather its K/V through the block table and run causal SDPA."""
    out = torch.empty_like(q)
    block_size = batch.block_size
    groups = q.shape[1] // cache.shape[-2]
    row = 0
    for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = batch.block_tables[i, :n_blocks].long()
        k = cache[0, blocks].reshape(-1, cache.shape[-2], cache.shape[-1])[:ctx_len]
        v = cache[1, blocks].reshape(-1, cache.shape[-2], cache.shape[-1])[:ctx_len]
        qi = q[row:row + q_len].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype)
        v = v.transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype)
        # query j sits at absolute position ctx_len - q_len + j and sees keys 0..that position
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
        out[row:row + q_len] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        row += q_len
    return out


def contiguous_batch(seq_lens: list[int], num_layers: int, num_kv_heads: int, head_dim: int, *,
                     dtype: torch.dtype, device: torch.device | str = "cpu", block_size: int = 16) -> AttentionBatch:
    """A prefill batch over a scratch cache where each sequence owns consecutive blocks.

    For running a model without an engine (parity tests, one-shot tools): feed whole sequences.
    """
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    total_blocks = sum(blocks_per_seq)
    max_blocks = max(blocks_per_seq)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    slots = []
    first = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += nb
    caches = [torch.zeros(2, total_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
              for _ in range(num_layers)]
    return AttentionBatch(list(seq_lens), list(seq_lens), torch.cat(slots).to(device), block_tables.to(device),
                          caches, block_size)
