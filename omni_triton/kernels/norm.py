"""RMSNorm, residual add + RMSNorm, and per-head q/k RMSNorm + rotary (queries and keys together) in one launch
each.

Each replaces five to twenty small torch launches per layer, which is what a decode step is made of. They
round where the torch reference (``models.layers.norm`` / ``rope``) rounds -- the normalised row to the input
dtype before the weight, every product and sum of the rotary to the activation dtype -- so in bf16 they agree
with it bit for bit up to the last ulp of ``rsqrt``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, n_cols, stride_x, stride_r,
                     stride_out, stride_rout, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # the residual stream keeps its dtype
        tl.store(residual_out_ptr + row * stride_rout + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    residual2 = residual_out = None
    if residual is not None:
        residual2 = residual.reshape(-1, shape[-1])
        residual_out = torch.empty_like(residual2)
    block = triton.next_power_of_2(shape[-1])
    pdl = enabled_for(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, residual2 if residual is not None else x2, weight, out, residual_out if residual is not None else out,
        shape[-1], x2.stride(0), residual2.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual is not None else 0, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8), PDL=pdl, launch_pdl=pdl)
    return out.view(shape), None if residual_out is None else residual_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dim."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalise(x + residual), x + residual): a pre-norm block's residual add and the next norm."""
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def norm_rope_heads(rows, head_mask, weight_ptr, cos_row, sin_row, eps, scale, HEAD_DIM: tl.constexpr,
                    SCALED: tl.constexpr):
    """RMSNorm per head + rotary (rotate-half) of the heads whose first elements ``rows`` [R, 1] point at,
    with the cos/sin row of their position -> [R, HEAD_DIM] fp32 holding values of the input dtype.
    Shared by ``head_norm_rope`` and the code predictor's ``frame_attention``; under SCALED the heads are first
    multiplied by ``scale`` and rounded (a folded pre-norm's row scale, as the projection's output would be)."""
    dims = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    rotated_dims = (dims + half) % HEAD_DIM  # rotate-half: element d pairs with d +- half
    x = tl.load(rows + dims[None, :], mask=head_mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    x_rotated = tl.load(rows + rotated_dims[None, :], mask=head_mask, other=0.0).to(tl.float32)
    if SCALED:
        xf = (xf * scale).to(dtype).to(tl.float32)
        x_rotated = (x_rotated * scale).to(dtype).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
    weight_rotated = tl.load(weight_ptr + rotated_dims).to(tl.float32)[None, :]
    normed = (weight * (xf * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    normed_rotated = (weight_rotated * (x_rotated * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    sign = tl.where(dims < half, -1.0, 1.0)[None, :]
    cos = tl.load(cos_row + dims).to(tl.float32)[None, :]
    sin = tl.load(sin_row + dims).to(tl.float32)[None, :]
    return (normed * cos).to(dtype).to(tl.float32) + (normed_rotated * sign * sin).to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_token(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, token, num_heads, stride_xt, stride_xh,
                     stride_ot, stride_oh, stride_cos, stride_sin, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Every head of one token: ``norm_rope_heads`` from x into out."""
    heads = tl.arange(0, BLOCK_H)
    head_mask = (heads < num_heads)[:, None]
    out = norm_rope_heads(x_ptr + token * stride_xt + heads[:, None] * stride_xh, head_mask, weight_ptr,
                          cos_ptr + token * stride_cos, sin_ptr + token * stride_sin, eps, 1.0, HEAD_DIM, False)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                         v_ptr, cache_ptr, slot_ptr, num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt,
                         stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_vt, stride_vh, value_offset,
                         stride_cos, stride_sin, q_eps, k_eps,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0)
    if tl.program_id(1) == 0:
        _norm_rope_token(q_ptr, q_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, token, num_q_heads, stride_qt, stride_qh,
                         stride_qot, stride_qoh, stride_cos, stride_sin, q_eps, HEAD_DIM, BLOCK_H)
    elif STORE:  # the keys straight into their cache slot, the values copied beside them (store_kv's layout)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:  # negative: a padding row of a CUDA-graph batch, nothing stored
            row = cache_ptr + slot.to(tl.int64) * (num_k_heads * HEAD_DIM)
            _norm_rope_token(k_ptr, k_weight_ptr, cos_ptr, sin_ptr, row, token, num_k_heads, stride_kt, stride_kh,
                             0, HEAD_DIM, stride_cos, stride_sin, k_eps, HEAD_DIM, BLOCK_H)
            heads = tl.arange(0, BLOCK_H)[:, None]
            dims = tl.arange(0, HEAD_DIM)[None, :]
            mask = heads < num_k_heads
            value = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
            tl.store(row + value_offset + heads * HEAD_DIM + dims, value.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        _norm_rope_token(k_ptr, k_weight_ptr, cos_ptr, sin_ptr, k_out_ptr, token, num_k_heads, stride_kt, stride_kh,
                         stride_kot, stride_koh, stride_cos, stride_sin, k_eps, HEAD_DIM, BLOCK_H)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotary(RMSNorm_per_head(x)); cos/sin [T, head_dim] (rotate-half layout).

    The weight must have x's dtype (the rotary rounds to it, as the torch path does after the norm). The q/k
    kernel's launch with one tensor."""
    return _launch_norm_rope(x, None, weight, None, cos, sin, eps, eps)[0]


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, q_eps: float, k_eps: float,
                 store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``head_norm_rope`` of the queries and of the keys in one launch (one program per token and tensor):
    q [T, Hq, D], k [T, Hkv, D] (any token and head strides, e.g. column views of a packed qkv output).

    ``store`` = (v [T, Hkv, D], cache [2, blocks, block_size, Hkv, D], slot_mapping [T]): the keys go straight
    into their cache slots and the values beside them, as ``paged_attention.store_kv`` would put them (negative
    slot: skipped), and no key tensor comes back (None): the step's ``store_kv`` launch saved."""
    return _launch_norm_rope(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, store)


def _launch_norm_rope(q: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor, q_eps: float, k_eps: float,
                      store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Without k the grid has one program per token (the k branch never runs; q stands in for its arguments)."""
    num_tokens, num_q_heads, head_dim = q.shape
    tensors = 1 if k is None else 2
    if k is None:
        k, k_weight = q, q_weight
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("head_norm_rope / qk_norm_rope need the head dim contiguous")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in tokens or head_dim")
    num_k_heads = k.shape[1]
    q_out = torch.empty_like(q)
    v, cache, slots = store if store is not None else (q, q, q)  # unread placeholders without a store
    if store is not None:
        if v.shape != k.shape or v.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope store: v {tuple(v.shape)} must match k {tuple(k.shape)}, dim contiguous")
        if not cache.is_contiguous() or cache.shape[-2:] != k.shape[1:] or slots.shape != (num_tokens,):
            raise ValueError(f"qk_norm_rope store: cache {tuple(cache.shape)} (contiguous, [..., {num_k_heads}, "
                             f"{head_dim}]) and slots {tuple(slots.shape)} (one per token) do not fit k")
    returns_k = tensors == 2 and store is None  # a stored k goes to the cache, not back to the caller
    k_out = torch.empty_like(k) if returns_k else q_out
    if num_tokens:
        pdl = enabled_for(q)
        _qk_norm_rope_kernel[(num_tokens, tensors)](
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, v, cache, slots, num_q_heads, num_k_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
            k_out.stride(1), v.stride(0), v.stride(1), cache.stride(0), cos.stride(0), sin.stride(0), q_eps, k_eps,
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)),
            STORE=store is not None, num_warps=4, PDL=pdl, launch_pdl=pdl)
    return q_out, (k_out if returns_k else None)
