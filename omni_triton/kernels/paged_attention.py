"""Paged KV cache: the store of new K/V by slot mapping, and single-token decode attention.

Cache layout (``models.layers.attention``): one tensor per layer ``[2, num_blocks, block_size, kv_heads,
head_dim]``; the token at position ``p`` of a sequence lives at slot ``block_table[p // block_size] *
block_size + p % block_size``.

Prefill (``paged_prefill_attention``): every row of a step with prefill rows (fresh prompts, chunks after
cached context, and the decode rows of a mixed step, as 1-query sequences) in one launch, reading K/V through the block tables after the store: one program per (tile of
``BLOCK_M`` query rows of one sequence, query head), a flash-attention loop over ``BLOCK_N`` key positions up
to the tile's last causal position, online softmax in fp32, the probabilities rounded to the activation
dtype before the value product (as a fused SDPA does). It replaces a Python loop of SDPA calls per sequence
(3-5 launches each, per layer). The tile list is built on the host once per step and shared by all layers.

Decode: one program per (sequence, KV head, context split) holds the group of query heads that share that KV
head (GQA: K/V read once for the group), walks its part of the context in tiles of ``BLOCK_N`` positions
through the block table, and keeps an online softmax in fp32; when the batch is too small to fill the GPU the
context is split (flash-decoding) and the split that finishes last merges them, in split order (an arrival
ticket per sequence and KV head, ``kernels.scratch``, put back to 0 by that split: one launch, and the same bits
whichever split is last). Context lengths come from a device
tensor, so one launch (and one CUDA graph) serves any mix of lengths; a row with context length 0 is padding
and gets zeros. The score product is rounded to the activation dtype before scaling, as the torch decode path
rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous
from omni_triton.kernels.scratch import persistent_zeros


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_k, stride_v, value_offset, row_size,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding row of a CUDA-graph batch
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < row_size
    dst = cache_ptr + slot.to(tl.int64) * row_size + offsets
    key = tl.load(k_ptr + token * stride_k + offsets, mask=mask)
    value = tl.load(v_ptr + token * stride_v + offsets, mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + value_offset, value.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] -> cache slots ``slot_mapping`` [T] (negative: skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(1) != head_dim or v.stride(1) != head_dim or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv needs each token's heads contiguous")
    if not cache.is_contiguous():
        raise ValueError("store_kv needs a contiguous cache")
    row_size = num_kv_heads * head_dim
    if num_tokens:
        pdl = enabled_for(k)
        _store_kv_kernel[(num_tokens,)](k, v, cache, slot_mapping, k.stride(0), v.stride(0), cache.stride(0),
                                        row_size, BLOCK=triton.next_power_of_2(row_size), num_warps=4, PDL=pdl,
                                        launch_pdl=pdl)


@triton.jit
def _paged_tile(q, cache_ptr, table_ptr, kv_head, start, end, last_visible, m_i, l_i, acc, row_size, value_offset,
                scale, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                ROUND_SCORES: tl.constexpr):
    """One online-softmax step over key positions start..start+BLOCK_N-1 (< end) of one sequence's pages
    (``table_ptr``: its block-table row), for query rows that see keys up to ``last_visible`` (one position
    per row) -> updated (running max, running sum, accumulator)."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_mask = pos < end
    page = tl.load(table_ptr + pos // PAGE, mask=pos_mask, other=0)
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    key_ptrs = cache_ptr + slot[:, None] * row_size + kv_head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(key_ptrs, mask=pos_mask[:, None], other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
    if ROUND_SCORES:  # the torch decode path rounds the product to the activation dtype
        scores = scores.to(q.dtype).to(tl.float32)
    visible = pos_mask[None, :] & (pos[None, :] <= last_visible[:, None])
    scores = tl.where(visible, scores * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    probs = tl.exp(scores - m_new[:, None])
    values = tl.load(key_ptrs + value_offset, mask=pos_mask[:, None], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(probs.to(q.dtype), values, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(probs, axis=1), acc


@triton.jit
def _paged_decode_kernel(q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partial_ptr, stats_ptr,
                         counter_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_table, value_offset, num_kv_heads,
                         num_heads, scale, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # split s walks its own run of whole BLOCK_N tiles of the context
    split_len = tl.cdiv(tl.cdiv(context_len, SPLITS), BLOCK_N) * BLOCK_N
    begin = split * split_len
    end = tl.minimum(begin + split_len, context_len)
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group
    head_mask = (group < GROUP)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_mask, other=0.0)
    row_size = num_kv_heads * HEAD_DIM
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    every_key = tl.zeros([BLOCK_G], dtype=tl.int32) + end  # one query per row: no causal limit inside the context
    for start in range(begin, end, BLOCK_N):
        m_i, l_i, acc = _paged_tile(q, cache_ptr, block_tables_ptr + seq * stride_table, kv_head, start, end,
                                    every_key, m_i, l_i, acc, row_size, value_offset, scale, HEAD_DIM, PAGE, BLOCK_N,
                                    PRECISION, ROUND_SCORES=True)
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows (no context): acc is 0
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        # partial results [B, heads, SPLITS, D] and (max, sum) [B, heads, SPLITS, 2], through L2 only (.cg: another
        # SM's L1 may hold a previous call's values here); the split that arrives last merges them in split order
        # (the same bits whoever it is) and resets the ticket for the next call and graph replay
        row = (seq * num_heads + heads) * SPLITS + split
        group_mask = group < GROUP
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_mask, cache_modifier=".cg")
        tl.store(stats_ptr + row * 2, m_i, mask=group_mask, cache_modifier=".cg")
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=group_mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partials stored before the ticket releases them
        ticket = counter_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLITS - 1:
            first = (seq * num_heads + heads) * SPLITS
            m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                m = tl.maximum(m, tl.load(stats_ptr + (first + s) * 2, mask=group_mask, other=float("-inf"),
                                          cache_modifier=".cg"))
            m = tl.where(m > float("-inf"), m, 0.0)  # a padding row fills no split
            total = tl.zeros([BLOCK_G], dtype=tl.float32)
            merged = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                m_s = tl.load(stats_ptr + (first + s) * 2, mask=group_mask, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(stats_ptr + (first + s) * 2 + 1, mask=group_mask, other=0.0, cache_modifier=".cg")
                filled = m_s > float("-inf")  # splits past the context hold nothing
                weight = tl.where(filled, tl.exp(tl.where(filled, m_s, m) - m), 0.0)
                total += weight * l_s
                merged += weight[:, None] * tl.load(partial_ptr + (first + s)[:, None] * HEAD_DIM + dims[None, :],
                                                    mask=head_mask, other=0.0, cache_modifier=".cg")
            out = merged / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=head_mask)
            tl.store(ticket, 0)


@triton.jit
def _paged_prefill_kernel(q_ptr, cache_ptr, block_tables_ptr, tiles_ptr, seqs_ptr, out_ptr, stride_qt, stride_qh,
                          stride_ot, stride_oh, stride_table, value_offset, num_kv_heads, scale,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tiles_ptr + tile * 2)  # batch index of the sequence (its block-table row)
    first_query = tl.load(tiles_ptr + tile * 2 + 1)  # the tile's first query, counted within the sequence
    first_row = tl.load(seqs_ptr + seq * 3)  # the sequence's first row in q/out
    query_len = tl.load(seqs_ptr + seq * 3 + 1)
    context_len = tl.load(seqs_ptr + seq * 3 + 2)  # new tokens included
    queries = first_query + tl.arange(0, BLOCK_M)
    query_mask = queries < query_len
    query_pos = context_len - query_len + queries  # absolute position: sees keys 0..query_pos
    dims = tl.arange(0, HEAD_DIM)
    rows = (first_row + queries).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=query_mask[:, None],
                other=0.0)
    row_size = num_kv_heads * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = tl.minimum(context_len, context_len - query_len + first_query + BLOCK_M)
    for start in range(0, end, BLOCK_N):
        # every row sees key 0 in the first tile, so m_i is finite from then on (no inf - inf)
        m_i, l_i, acc = _paged_tile(q, cache_ptr, block_tables_ptr + seq * stride_table, kv_head, start, end,
                                    query_pos, m_i, l_i, acc, row_size, value_offset, scale, HEAD_DIM, PAGE, BLOCK_N,
                                    PRECISION, ROUND_SCORES=False)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=query_mask[:, None])


PREFILL_BLOCK_M = 64  # query rows per program (the tile list is cut to it)


def prefill_tile_rows(seqs: list[tuple[int, int, int, int]]
                      ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Host lists of ``prefill_tiles``: (tiles, sequences); a sequence index missing from ``seqs`` gets (0, 0, 0)
    (no query: its tiles, if any point there, write nothing)."""
    by_index = {index: (row, q_len, ctx_len) for index, row, q_len, ctx_len in seqs}
    table = [by_index.get(i, (0, 0, 0)) for i in range(max(by_index) + 1)]
    tiles = [(index, q0) for index, _, q_len, _ in seqs for q0 in range(0, q_len, PREFILL_BLOCK_M)]
    return tiles, table


def max_prefill_tiles(num_tokens: int, max_seqs: int) -> int:
    """An upper bound on ``len(prefill_tile_rows(seqs)[0])`` for any ``seqs`` of at most ``max_seqs`` sequences and
    ``num_tokens`` rows in all: full tiles, plus at most one partial tile per sequence (a CUDA graph's grid)."""
    return num_tokens // PREFILL_BLOCK_M + min(max_seqs, num_tokens)


def prefill_tiles(seqs: list[tuple[int, int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs: (batch index, first row, query len, context len) of each prefill sequence -> (tiles [n, 2] int32:
    (sequence's entry in the second tensor, first query), sequences [S, 3] int32: (first row, query len, context
    len), indexed like the block tables when built from every sequence of the batch)."""
    tiles, table = prefill_tile_rows(seqs)
    pinned = device.type == "cuda"
    as_device = [torch.tensor(t, dtype=torch.int32).pin_memory() if pinned else torch.tensor(t, dtype=torch.int32)
                 for t in (tiles, table)]
    return tuple(t.to(device, non_blocking=True) for t in as_device)


def paged_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, tiles: torch.Tensor,
                            seqs: torch.Tensor, scale: float | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] (rows of prefill sequences; their K/V already stored), cache of one layer,
    block_tables [B, max_blocks] int32, (tiles, seqs) from ``prefill_tiles`` -> ``out`` [T, heads, head_dim]
    with the prefill rows written (other rows left as they are)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = cache.shape
    if q.stride(2) != 1 or block_tables.stride(1) != 1 or not cache.is_contiguous():
        raise ValueError("paged_prefill_attention needs q's head dim, the block tables' rows and the cache "
                         "contiguous")
    out = torch.empty_like(q) if out is None else out
    if tiles.shape[0]:
        pdl = enabled_for(q)
        _paged_prefill_kernel[(tiles.shape[0], num_heads)](
            q, cache, block_tables, tiles, seqs, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), cache.stride(0), num_kv_heads, head_dim ** -0.5 if scale is None else scale,
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2, PDL=pdl,
            launch_pdl=pdl)
    return out


def decode_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Context splits per (sequence, KV head): enough programs for two to four per SM when the batch alone
    gives too few (one sequence, four KV heads: 4 programs would each walk the whole context). Measured
    (benchmarks/decode_attention_bench.py, benchmarks/results/h200-sorted-layout/) the best split counts gave
    256-512 programs; the earlier target of one to two per SM left the talker at 32-64 rows and the thinker at
    32 with half that (talker at 64 rows and 640 positions: 25.3 us a call unsplit, 19.6 with 2 splits)."""
    return max(1, min(16, triton.next_power_of_2(4 * num_sms // max(1, batch * num_kv_heads)) // 2))


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, heads, head_dim] (one new token per sequence, its K/V already stored), cache of one layer,
    block_tables [B, max_blocks] int32, context_lens [B] int (new token included) -> [B, heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = cache.shape
    if q.stride(2) != 1 or block_tables.stride(1) != 1 or not cache.is_contiguous():
        raise ValueError("paged_decode_attention needs q's head dim, the block tables' rows and the cache "
                         "contiguous")
    out = torch.empty_like(q)
    if not batch:
        return out
    splits = decode_splits(batch, num_kv_heads)
    partial = stats = counters = out  # unread placeholders of an unsplit launch
    if splits > 1:
        partial = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
        counters = persistent_zeros("paged_decode", q.device, torch.int32, batch * num_kv_heads)
    group = num_heads // num_kv_heads
    pdl = enabled_for(q)
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, cache, block_tables, context_lens, out, partial, stats, counters, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), cache.stride(0), num_kv_heads, num_heads,
        head_dim ** -0.5 if scale is None else scale, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAGE=page, BLOCK_N=64, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2, PDL=pdl, launch_pdl=pdl)
    return out
