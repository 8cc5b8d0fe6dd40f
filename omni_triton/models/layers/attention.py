"""The one attention interface every causal model in the package goes through.

Models see a *flat varlen batch*: the new tokens of all sequences concatenated along dim 0
(prefill chunks and single decode tokens mixed). ``AttentionBatch`` knows, per sequence, which rows
are its tokens, how much context it already has in the paged KV cache, and where (slot) each new
token's K/V goes. A model layer calls ``batch.attend(layer_idx, q, k, v)``; it never sees blocks. A batch
whose ``kv_store(layer_idx)`` gives (cache, slots) lets a kernel write the step's K/V itself (the fast path's
q/k norm + rotary, ``kernels.norm.qk_norm_rope(store=...)``); the layer then passes k as None.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
a token at logical position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``, i.e. slot ``block * block_size + offset``.

Two implementations of the same math: ``attend_paged`` (reference: one gather + masked SDPA per sequence)
and the default ``attend_fast``, which avoids gathers where it can: on CUDA a step with prefill rows (fresh,
chunked, mixed with decode rows) goes through one Triton launch per layer reading the block tables in place
(``kernels.paged_attention.paged_prefill_attention``); elsewhere a fresh prefill (no cached context)
attends to its own new K/V with causal SDPA; all single-token decode rows run as one batched grouped-query
attention (on CUDA the Triton kernel ``kernels.paged_attention`` reading the block tables in place; else one
gather for the whole decode batch per layer, K/V never repeated per query head); only chunked prefill with
cached context gathers per sequence (off CUDA). Its per-batch plan is built once and shared by all layers.

``DecodeBatch`` is the CUDA-graph form of a decode-only batch: device tensors only (no host lists), padding
rows marked by a negative slot and a zero context length, K/V stored and attended by the Triton kernels;
``VarlenGraphBatch`` the same for a step with prefill rows (the prefill kernel's tile list, padded).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionBatch:
    query_lens: list[int]  # new tokens per sequence, in batch order (host ints)
    context_lens: list[int]  # tokens in the KV cache per sequence after this step, new ones included
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    block_size: int
    use_reference: bool = False  # True: the per-sequence gather path (the oracle for the fast path)
    use_kernels: bool = True  # CUDA decode rows through the Triton kernel (False: the torch gather path)
    use_prefill_kernel: bool = True  # with use_kernels, CUDA prefill rows through one Triton launch per layer
    _plan: "_AttentionPlan | None" = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token (where its next-token logits come from)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.slot_mapping.device)

    def kv_store(self, layer_idx: int) -> None:
        """Where a kernel may write this step's K/V itself: nowhere (the fast path attends to k and v directly)."""
        return None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> [T, Hq, D]. Writes k/v to the cache first."""
        cache = self.kv_caches[layer_idx]
        flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
        flat[0].index_copy_(0, self.slot_mapping, k.to(cache.dtype))
        flat[1].index_copy_(0, self.slot_mapping, v.to(cache.dtype))
        if self.use_reference:
            return attend_paged(q, cache, self, scale)
        if self._plan is None:
            self._plan = _AttentionPlan.build(self)
        return attend_fast(q, k, v, cache, self._plan, scale, use_kernels=self.use_kernels and q.is_cuda,
                           use_prefill_kernel=self.use_prefill_kernel)


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


@dataclass
class _AttentionPlan:
    """How attend_fast splits a batch; built from host ints once per batch, reused by every layer."""
    decode_rows: torch.Tensor | None  # [Bd] rows (and sequences' tables below) of single-token decodes
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] int64, -1 replaced by 0 (masked anyway)
    decode_valid: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool: key position < context
    decode_context_lens: torch.Tensor | None  # [Bd] int32
    fresh_prefills: list[tuple[int, int]]  # (first row, length) of prefills with no cached context
    chunked_prefills: list[tuple[int, int, int, torch.Tensor]]  # (first row, q_len, ctx_len, block ids)
    # (index, row, q_len, ctx_len) of every sequence when the step has prefill rows (the prefill kernel then
    # takes the decode rows too: one launch per layer for a mixed step); empty for a decode-only step
    kernel_seqs: list[tuple[int, int, int, int]] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # the batch's, for the prefill kernel
    prefill_kernel_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # kernels.paged_attention.prefill_tiles

    @classmethod
    def build(cls, batch: AttentionBatch) -> "_AttentionPlan":
        device = batch.slot_mapping.device
        decode_rows, decode_seqs, fresh, chunked, every = [], [], [], [], []
        row = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
            every.append((i, row, q_len, ctx_len))
            if q_len == 1 and ctx_len > 1:
                decode_rows.append(row)
                decode_seqs.append(i)
            else:
                if q_len == ctx_len:
                    fresh.append((row, q_len))
                else:
                    n_blocks = -(-ctx_len // batch.block_size)
                    chunked.append((row, q_len, ctx_len, batch.block_tables[i, :n_blocks].long()))
            row += q_len
        kernel_seqs = every if fresh or chunked else []
        if not decode_rows:
            return cls(None, None, None, None, fresh, chunked, kernel_seqs, batch.block_tables)
        ctx = _host_to_device([batch.context_lens[i] for i in decode_seqs], device)
        max_blocks = -(-int(max(batch.context_lens[i] for i in decode_seqs)) // batch.block_size)
        tables = batch.block_tables[_host_to_device(decode_seqs, device), :max_blocks].long().clamp_min(0)
        valid = torch.arange(max_blocks * batch.block_size, device=device)[None, :] < ctx[:, None]
        return cls(_host_to_device(decode_rows, device), tables, valid[:, None, None, :], ctx.int(), fresh, chunked,
                   kernel_seqs, batch.block_tables)


def _host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Pinned, non-blocking copy: building the plan mid-forward must not make the host wait for the GPU."""
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def attend_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, plan: _AttentionPlan,
                scale: float | None, use_kernels: bool = False, use_prefill_kernel: bool = True) -> torch.Tensor:
    out = torch.empty_like(q)
    # round new K/V like the cache does, so results don't depend on whether they were read back from it
    k, v = (t.to(cache.dtype).to(q.dtype) for t in (k, v))
    if use_kernels and use_prefill_kernel and plan.kernel_seqs:  # every row in one launch, K/V read from the cache
        from omni_triton.kernels.paged_attention import paged_prefill_attention, prefill_tiles

        if plan.prefill_kernel_inputs is None:
            plan.prefill_kernel_inputs = prefill_tiles(plan.kernel_seqs, q.device)
        return paged_prefill_attention(q, cache, plan.block_tables, *plan.prefill_kernel_inputs, scale, out=out)
    _attend_prefills(q, k, v, cache, plan, scale, out, use_kernels)
    if plan.decode_rows is not None and use_kernels:
        from omni_triton.kernels.paged_attention import paged_decode_attention

        out[plan.decode_rows] = paged_decode_attention(q[plan.decode_rows], cache, plan.decode_tables,
                                                       plan.decode_context_lens, scale)
    elif plan.decode_rows is not None:
        rows = plan.decode_rows
        keys = cache[0, plan.decode_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [Bd, Hkv, L, D]
        values = cache[1, plan.decode_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
        out[rows] = _decode_attention(q[rows], keys, values, plan.decode_valid, scale)
    return out


def _attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, plan: _AttentionPlan,
                     scale: float | None, out: torch.Tensor, use_kernels: bool) -> None:
    """Prefill rows through SDPA, one call per sequence (the torch path; the prefill kernel replaces it on CUDA)."""
    gqa = q.shape[1] != k.shape[1]
    # The fast path asks for flash attention (GQA without K/V copies), which takes only 4-D inputs: with the
    # 3-D ones of the CPU path, torch fell back to its fp32 math attention on the GPU (measured in the prefill
    # profile: fp32 GEMMs + softmax + elementwise, a third of a 2048-token step's GPU time).
    with sdpa_kernel(PREFILL_BACKENDS) if use_kernels else contextlib.nullcontext():
        for row, n in plan.fresh_prefills:
            qi, ki, vi = (t[row:row + n].transpose(0, 1) for t in (q, k, v))
            if use_kernels:
                qi, ki, vi = qi[None], ki[None], vi[None]
            attended = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
            out[row:row + n] = attended.reshape(q.shape[1], n, q.shape[2]).transpose(0, 1)
        for row, q_len, ctx_len, blocks in plan.chunked_prefills:
            keys = cache[0, blocks].flatten(0, 1)[:ctx_len].transpose(0, 1).to(q.dtype)  # [Hkv, ctx, D]
            values = cache[1, blocks].flatten(0, 1)[:ctx_len].transpose(0, 1).to(q.dtype)
            # query j sits at position ctx_len - q_len + j: a bottom-right aligned causal mask
            mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril(ctx_len - q_len)
            out[row:row + q_len] = F.scaled_dot_product_attention(q[row:row + q_len].transpose(0, 1), keys, values,
                                                                  attn_mask=mask, scale=scale,
                                                                  enable_gqa=gqa).transpose(0, 1)


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """q [B, Hq, D] (one token each), keys/values [B, Hkv, L, D], valid [B, 1, 1, L] -> [B, Hq, D].

    Query heads are grouped onto their KV head as a matmul dimension, so K/V are read once per KV head
    (no repeat_interleave copy); softmax in fp32."""
    batch, num_heads, head_dim = q.shape
    grouped = q.view(batch, keys.shape[1], num_heads // keys.shape[1], head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * (head_dim ** -0.5 if scale is None else scale)
    probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


@dataclass
class DecodeBatch:
    """One new token per row, as device tensors only (a CUDA graph replays it with new contents)."""
    slot_mapping: torch.Tensor  # [B] int64: cache slot of each row's new token; negative = padding row
    block_tables: torch.Tensor  # [B, max_blocks] int32 (entries past a row's context are never read)
    context_lens: torch.Tensor  # [B] int: tokens in the cache after this step; 0 = padding row
    kv_caches: list[torch.Tensor]

    def kv_store(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache, slot_mapping) for ``kernels.norm.qk_norm_rope``'s store: K/V written by the norm kernel."""
        return self.kv_caches[layer_idx], self.slot_mapping

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """k None: the step's K/V are in the cache already (``kv_store``)."""
        from omni_triton.kernels.paged_attention import paged_decode_attention, store_kv

        cache = self.kv_caches[layer_idx]
        if k is not None:
            store_kv(k, v, cache, self.slot_mapping)
        return paged_decode_attention(q, cache, self.block_tables, self.context_lens, scale)


@dataclass
class VarlenGraphBatch:
    """A step with prefill rows (fresh, chunked, mixed with decode rows) as device tensors only, for a CUDA graph
    of a fixed token count: the tile list of ``kernels.paged_attention.prefill_tile_rows`` padded to a fixed
    length with tiles of an empty sequence, padding rows marked by a negative slot. Padding rows attend to
    nothing and get zeros (so they stay finite through the layers: zero in, zero out of every block)."""
    slot_mapping: torch.Tensor  # [T] int64; negative = padding row
    block_tables: torch.Tensor  # [S, max_blocks] int32
    tiles: torch.Tensor  # [n, 2] int32 (sequence index, first query)
    seqs: torch.Tensor  # [S, 3] int32 (first row, query len, context len); (0, 0, 0) = no sequence
    kv_caches: list[torch.Tensor]

    def kv_store(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``DecodeBatch.kv_store``."""
        return self.kv_caches[layer_idx], self.slot_mapping

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """k None: the step's K/V are in the cache already (``kv_store``)."""
        from omni_triton.kernels.paged_attention import paged_prefill_attention, store_kv

        cache = self.kv_caches[layer_idx]
        if k is not None:
            store_kv(k, v, cache, self.slot_mapping)
        return paged_prefill_attention(q, cache, self.block_tables, self.tiles, self.seqs, scale,
                                       out=torch.zeros_like(q))


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
