"""A linear layer for few rows (M <= ~128) with its neighbours fused in: one launch instead of two or three.

    small_linear(x, W)                               x @ W.T
    small_linear(x, W, norm_weight=w, eps=e)         RMSNorm(x) @ W.T          (the pre-norm of a block)
    small_linear(x, W, gated=True)                   silu(x @ Wg.T) * (x @ Wu.T), W = [Wg; Wu] packed
    small_linear(x, W, residual=r)                   r + x @ W.T               (the residual add after it)

Made for the code predictor (hidden 1024, heads 16/8 x 128, MLP 3072, 2048 codes; 1..64 rows per step, 2x
that in the frame's first step), whose 15 steps per frame are weight-read bound: every step streams all
~150 MB of its weights for a handful of rows. So the grid spreads the *output columns* over as many programs
as it can (``BLOCK_N`` 16 or 32; one program per column block and row block) so that each reads a thin slice
of W once, pipelined over K in ``BLOCK_K`` steps; the rows are padded to ``BLOCK_M`` >= 16 (the smallest
``tl.dot`` tile) and the wasted MMA work is free at this arithmetic intensity. The normalised input is
recomputed by each program (x is a few KB), which costs nothing next to its W slice.

Roundings follow the torch modules (``models.layers.norm.RMSNorm``, ``GatedMLP``, the residual adds of
``DecoderLayer``): the normalised row to the input dtype before the weight, the product to the input dtype,
each GEMM output to the input dtype, then the activation, its product with up, and the residual sum, each
rounded. Only the accumulation order of the dot products differs from cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _small_linear_kernel(x_ptr, w_ptr, out_ptr, norm_weight_ptr, residual_ptr, M, N, K,
                         stride_xm, stride_wn, stride_om, stride_rm, eps,
                         NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # first pass over the row: its mean square
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_mask = kk < K
        a = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            normed = (a.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            weight = tl.load(norm_weight_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = (weight[None, :] * normed).to(dtype)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc = tl.dot(a, tl.load(w_cols + kk[:, None], mask=w_mask, other=0.0), acc, input_precision=PRECISION)
        if GATED:  # the up half of W starts N rows further down
            up = tl.load(w_cols + N * stride_wn + kk[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    out = acc.to(dtype)
    if GATED:
        gate = out.to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (activated * acc_up.to(dtype).to(tl.float32)).to(dtype)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=out_mask,
                           other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def block_sizes(rows: int, cols: int, depth: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): rows padded to a dot tile (16..64); column blocks of 16 for narrow outputs
    (the predictor's o/down projections, N=1024: 64 programs) with K steps of 256, so each program keeps as
    many weight bytes in flight as a wide one; column blocks of 32 and K steps of 128 for wide outputs (qkv
    4096, gate/up 3072, lm_head 2048: 64-128 programs). At most a few hundred KB of W per program."""
    narrow = cols <= 1024
    block_k = min(256 if narrow else 128, max(16, triton.next_power_of_2(depth)))
    return min(64, max(16, triton.next_power_of_2(rows))), 16 if narrow else 32, block_k


def small_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (any row stride), weight [N, K] ([2N, K]: gate rows then up rows when ``gated``) -> [M, N].

    The result is rounded to x's dtype (as the torch layer's output is) and stored as ``out_dtype`` (default
    x's dtype; float32 for logits)."""
    rows, depth = x.shape
    cols = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != depth:
        raise ValueError(f"small_linear needs contiguous rows and matching K: x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (rows, cols) or residual.stride(1) != 1):
        raise ValueError(f"small_linear residual {tuple(residual.shape)} does not match the output ({rows}, {cols})")
    out = torch.empty(rows, cols, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n, block_k = block_sizes(rows, cols, depth)
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _small_linear_kernel[grid](
        x, weight, out, x if norm_weight is None else norm_weight, out if residual is None else residual,
        rows, cols, depth, x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0), eps,
        NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=3 if x.element_size() <= 2 else 2)  # fp32 tiles are twice the shared memory
    return out
