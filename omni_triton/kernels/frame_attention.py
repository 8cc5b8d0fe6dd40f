"""The code predictor's attention of one step in one launch: q/k RMSNorm + rotary, the K/V store into the
frame's tiny cache, and attention over at most ``MAX_POSITIONS`` positions.

Every row of a code-predictor batch is at the same step, so its cache is contiguous, ``[B, kv_heads, L, D]``
per layer (``models.code_predictor.FrameCache``), and the step's new tokens sit at positions ``start ..
start + new - 1`` of every row (2 new tokens in the frame's first step, then 1). One program (one warp) per
(row, query head): it loads its KV head's earlier keys and values, normalises and rotates the new keys, keeps
them in its K/V tiles (no read-back of what was just stored: no barrier), then for each new token normalises
and rotates its query and attends causally over positions ``0 .. its own``. The programs of a GQA group compute
the same new keys; the group's first one stores them and the new values (the others read only earlier
positions, stored by earlier steps). With L <= 16 the score row ``[L]`` and the K/V tiles ``[L, D]`` live in
one warp's registers: no online softmax, no tensor cores, one pass.

Why a program per query head and one warp, rather than one four-warp program per KV head sharing its K/V tiles
over the group: after the qkv GEMV it leans on, the narrow program costs about half as much
at one row and less at 64 (docs/performance.md), and it runs 75 times a frame.

Roundings: q and k as ``kernels.norm.head_norm_rope`` (the torch module order); scores, softmax and the
weighted sum in fp32, the output rounded once to the activation dtype, as a fused SDPA does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous

from omni_triton.kernels.norm import norm_rope_heads

MAX_POSITIONS = 16  # a frame's code predictor sees talker hidden + 15 codebook embeddings at most


@triton.jit
def _frame_attention_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, out_ptr, x_ptr,
                            qkv_rows_ptr, start, num_kv_heads, stride_qkv, stride_out, stride_cache_row,
                            stride_cache_head, stride_rope, stride_x, hidden, eps, x_eps, scale,
                            NEW: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
                            X_NORM: tl.constexpr, BLOCK_X: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    # a head goes through the shared q/k norm+rope helper as a tile of two rows, the second masked off
    # (a two-row tile rather than a one-row one: the smallest shape every Triton version lays out happily)
    pair = tl.arange(0, 2)[:, None]
    first = pair < 1
    stores = (dims * 0 + head % GROUP) == 0  # [D]: the group's first program writes the cache (a tensor mask)
    q_size = num_kv_heads * GROUP * HEAD_DIM
    kv_size = num_kv_heads * HEAD_DIM
    cache = row.to(tl.int64) * stride_cache_row + kv_head * stride_cache_head
    positions = tl.arange(0, BLOCK_L)
    # the earlier steps' keys and values (all loads issued at once), then this step's merged in from registers
    cached = (positions < start)[:, None]
    keys = tl.load(keys_ptr + cache + positions[:, None] * HEAD_DIM + dims[None, :], mask=cached,
                   other=0.0).to(tl.float32)
    values = tl.load(values_ptr + cache + positions[:, None] * HEAD_DIM + dims[None, :], mask=cached,
                     other=0.0).to(tl.float32)
    # the folded pre-norm's row scale of each new token (NEW <= 2), computed once for its key and its query
    first_token = (row * NEW).to(tl.int64)
    first_rstd = _input_rstd(x_ptr + first_token * stride_x, hidden, x_eps, X_NORM, BLOCK_X)
    last_rstd = first_rstd
    if NEW > 1:
        last_rstd = _input_rstd(x_ptr + (first_token + 1) * stride_x, hidden, x_eps, X_NORM, BLOCK_X)
    for j in tl.static_range(NEW):  # the new keys (normed, rotated) and values: into the tiles and the cache
        token = (row * NEW + j).to(tl.int64)
        position = start + j
        x_rstd = first_rstd if j == 0 else last_rstd
        qkv_row = qkv_ptr + _qkv_row(qkv_rows_ptr, token, GATHER) * stride_qkv
        k_row = qkv_row + q_size + kv_head * HEAD_DIM + pair * 0
        key = norm_rope_heads(k_row, first, k_norm_ptr, cos_ptr + position * stride_rope,
                              sin_ptr + position * stride_rope, eps, x_rstd, HEAD_DIM,
                              X_NORM).to(keys_ptr.dtype.element_ty)
        value = tl.load(qkv_row + q_size + kv_size + kv_head * HEAD_DIM + dims)
        if X_NORM:
            value = (value.to(tl.float32) * x_rstd).to(value.dtype)
        value = value.to(values_ptr.dtype.element_ty)
        tl.store(keys_ptr + cache + position * HEAD_DIM + pair * 0 + dims[None, :], key, mask=first & stores[None, :])
        tl.store(values_ptr + cache + position * HEAD_DIM + dims, value, mask=stores)
        # as read back from the cache: rounded to its dtype
        key_row = tl.sum(tl.where(first, key.to(tl.float32), 0.0), axis=0)  # [D]
        at = (positions == position)[:, None]
        keys = tl.where(at, key_row[None, :], keys)
        values = tl.where(at, value.to(tl.float32)[None, :], values)
    for j in tl.static_range(NEW):
        token = (row * NEW + j).to(tl.int64)
        position = start + j
        x_rstd = first_rstd if j == 0 else last_rstd
        q_row = qkv_ptr + _qkv_row(qkv_rows_ptr, token, GATHER) * stride_qkv + head * HEAD_DIM + pair * 0
        query = norm_rope_heads(q_row, first, q_norm_ptr, cos_ptr + position * stride_rope,
                                sin_ptr + position * stride_rope, eps, x_rstd, HEAD_DIM, X_NORM)
        query = tl.sum(tl.where(first, query, 0.0), axis=0)  # [D]
        scores = tl.sum(query[None, :] * keys, axis=1) * scale  # [BLOCK_L]
        scores = tl.where(positions <= position, scores, float("-inf"))
        probs = tl.exp(scores - tl.max(scores, axis=0))
        probs = probs / tl.sum(probs, axis=0)
        attended = tl.sum(probs[:, None] * values, axis=0)  # [D]
        tl.store(out_ptr + token * stride_out + head * HEAD_DIM + dims, attended.to(out_ptr.dtype.element_ty))


@triton.jit
def _qkv_row(qkv_rows_ptr, token, GATHER: tl.constexpr):
    """The qkv row of a new token: its own, or under GATHER the table row it names."""
    if GATHER:
        return tl.load(qkv_rows_ptr + token).to(tl.int64)
    return token


@triton.jit
def _input_rstd(x_row, hidden, eps, X_NORM: tl.constexpr, BLOCK_X: tl.constexpr):
    """rsqrt(mean(x_row^2) + eps): the row scale of the qkv projection's pre-norm, folded into its weight."""
    rstd = 1.0
    if X_NORM:
        cols = tl.arange(0, BLOCK_X)
        x = tl.load(x_row + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    return rstd


def frame_attention(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    new: int, num_heads: int, eps: float, scale: float,
                    input_norm: tuple[torch.Tensor, float] | None = None,
                    qkv_rows: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B * new, (Hq + 2 Hkv) * D] (row-major: row b's new tokens consecutive; q heads, k heads, v heads),
    keys/values [B, Hkv, L, D] (this layer's frame cache; positions < start filled by earlier steps),
    cos/sin [>= start + new, D] (rows = positions) -> attention output [B * new, Hq * D].

    ``input_norm`` = (x [B * new, H], eps): qkv is ``x @ (W * norm_weight).T``, the projection of x with its
    RMSNorm's weight folded in, so q, k and v are first scaled by their row's ``rsqrt(mean(x^2) + eps)`` and
    rounded (the folded pre-norm of the code predictor's served launch: no norm launch before the qkv GEMM).

    ``qkv_rows`` [B * new] (integer): qkv is a table and token t's q/k/v are its row ``qkv_rows[t]`` (the code
    predictor's first layer reads the projections of the codebook entry a step feeds, made once: no qkv GEMM)."""
    rows, num_kv_heads, max_len, head_dim = keys.shape
    qkv_cols = (num_heads + 2 * num_kv_heads) * head_dim
    if not (keys.is_contiguous() and values.is_contiguous() and qkv.stride(1) == 1 and cos.stride(1) == 1
            and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)):
        raise ValueError("frame_attention needs contiguous caches and unit-stride qkv/cos/sin rows")
    if (qkv.shape[1] != qkv_cols or (qkv_rows is None and qkv.shape[0] != rows * new)
            or start + new > max_len):
        raise ValueError(f"frame_attention: qkv {tuple(qkv.shape)} for {rows} rows x {new} new tokens at "
                         f"{start} in a cache of {max_len} positions")
    if qkv_rows is not None and (qkv_rows.shape != (rows * new,) or qkv_rows.dtype.is_floating_point):
        raise ValueError(f"frame_attention qkv_rows must be {rows * new} integer indices, got {qkv_rows.dtype} "
                         f"{tuple(qkv_rows.shape)}")
    if max_len > MAX_POSITIONS or head_dim & (head_dim - 1):
        raise ValueError(f"frame_attention takes <= {MAX_POSITIONS} positions and a power-of-2 head_dim, "
                         f"got {max_len} and {head_dim}")
    if input_norm is not None and (input_norm[0].shape[0] != rows * new or input_norm[0].stride(1) != 1 or new > 2):
        raise ValueError(f"frame_attention input_norm x {tuple(input_norm[0].shape)} must have {rows * new} "
                         f"unit-stride rows, for at most 2 new tokens a row (got {new})")
    x, x_eps = input_norm if input_norm is not None else (qkv, 0.0)
    group = num_heads // num_kv_heads
    out = torch.empty(rows * new, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        pdl = enabled_for(qkv)
        _frame_attention_kernel[(rows, num_heads)](
            qkv, q_norm_weight, k_norm_weight, cos, sin, keys, values, out, x,
            qkv if qkv_rows is None else qkv_rows.contiguous(), start, num_kv_heads, qkv.stride(0), out.stride(0),
            keys.stride(0), keys.stride(1), cos.stride(0), x.stride(0), x.shape[1], eps, x_eps, scale,
            NEW=new, GROUP=group, HEAD_DIM=head_dim, BLOCK_L=triton.next_power_of_2(max_len),
            X_NORM=input_norm is not None, BLOCK_X=triton.next_power_of_2(x.shape[1]) if input_norm else 16,
            GATHER=qkv_rows is not None, num_warps=1, PDL=pdl, launch_pdl=pdl)
    return out
