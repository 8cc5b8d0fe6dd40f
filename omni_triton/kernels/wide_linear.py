"""The code predictor's wide projections (qkv, gate/up) at 8-128 rows: a TMA GEMM inside the dependent-launch chain.

Where the served launch folds the predictor's pre-norms into its weights (``models.code_predictor``, from
``CUBLAS_MIN_ROWS`` rows), these products ran on cuBLAS: the fastest single call at these shapes, but cuBLAS does
not launch with PDL (``kernels.dependent_launch``), so the ~6-launch chain of every layer stalled twice (the GEMM
waited for the previous kernel to drain, then the next kernel for the GEMM), and gate/up's SiLU took a launch of
its own. This kernel keeps the chain: it pulls its slice of W into L2 before waiting for the previous kernel,
loads x and W tiles by TMA (tensor descriptors: one instruction a tile, where the pointer loads of
``kernels.small_linear`` keep its load units ~87% busy re-reading 64 rows of x per program), and applies the folded
pre-norm's row scale and the SiLU-and-mul in its epilogue; cuBLAS does not launch with PDL, so the chain stalled
around each of its GEMMs (the A/B: benchmarks/results/h200-qkv-tables/, docs/performance.md).

    wide_linear(x, W)                                   x @ W.T
    wide_linear(x, W, gated=True)                       silu(x @ Wg.T) * (x @ Wu.T), W = [Wg; Wu] packed
    wide_linear(x, W, gated=True, input_norm=(s, H, e)) the same with each row's rstd from its squares applied
                                                        first (W has the pre-norm's weight folded in)

Roundings: each product rounded to x's dtype, then (input_norm) scaled by the rstd and rounded, then the SiLU, its
product with up, each rounded: as ``silu_and_mul`` after a library GEMM. ``tma_ready`` says where the kernel can
run (Hopper or later, or Triton's interpreter; TMA-aligned strides; up to ``WIDE_MAX_ROWS`` rows), ``takes_tma``
where the served frame asks for it (16-64 rows, where it won); elsewhere ``wide_linear`` is cuBLAS (+
``silu_and_mul``), as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from omni_triton.kernels.activation import (checked_input_norm, rstd_from_squares, silu_and_mul, silu_times,
                                            square_block)
from omni_triton.kernels.dependent_launch import (INTERPRETED, enabled_for, hopper_or_later, prefetch_lines,
                                                  wait_for_previous)
from omni_triton.kernels.small_linear import prefetch_weight_slice

WIDE_MAX_ROWS = 128  # what the tiles cover (``wide_blocks``); past it cuBLAS
# Where the served frame takes the kernel (``takes_tma``), from an A/B of the talker frame's graph (a batch of B
# rows runs its first predictor step at 2B, the other 14 at B; step_exposure.py, h200-qkv-tables/tma-rows/): from
# 16 rows it won (B = 16: 4.268 -> 4.250 ms, B = 32: 4.569 -> 4.478, B = 64: 5.19 -> 4.84 with the tables), at
# B = 8 it lost (3.825 -> 3.953): the 64-row MMA tile costs as much at 8 rows as at 64, where cuBLAS picks smaller
# tiles. Past 64 rows the 128-row tile lost to cuBLAS's (the predictor's 15 steps at B = 128: 3.017 -> 3.073 ms).
TMA_MIN_ROWS, TMA_MAX_ROWS = 16, 64
TMA_ALIGN = 16  # bytes: a TMA descriptor's base address and row strides


@triton.jit
def _wide_linear_kernel(x_desc, w_desc, w_ptr, out_ptr, squares_ptr, M, N, K, stride_om, stride_wn, square_blocks,
                        norm_size, eps, GATED: tl.constexpr, INPUT_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        SQUARE_BLOCK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                        PREFETCH_LINES: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    cols = n0 + tl.arange(0, BLOCK_N)
    prefetch_weight_slice(w_ptr, cols, cols < N, 0, K, N, stride_wn, GATED, PDL, PREFETCH_LINES)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([m0, k])  # rows past M and columns past K read as zeros
        acc = tl.dot(a, w_desc.load([n0, k]).T, acc, input_precision=PRECISION)
        if GATED:  # the up half of W starts N rows further down
            acc_up = tl.dot(a, w_desc.load([N + n0, k]).T, acc_up, input_precision=PRECISION)
    rows = m0 + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if INPUT_NORM:  # this row's rsqrt(mean(x^2) + eps), from the column blocks' sums of squares [blocks, M]
        rstd = rstd_from_squares(squares_ptr, rows, M, square_blocks, norm_size, eps, SQUARE_BLOCK)
        out = (out.to(tl.float32) * rstd[:, None]).to(dtype)
    if GATED:
        up = (acc_up.to(dtype).to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        out = silu_times(out.to(tl.float32), up, dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out, mask=mask)


def tma_ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``wide_linear`` runs the TMA kernel for these operands: Hopper or later (or the interpreter),
    at most ``WIDE_MAX_ROWS`` rows, unit-stride rows whose base and row stride are TMA-aligned."""
    if not (0 < x.shape[0] <= WIDE_MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1):
        return False
    if not all(t.data_ptr() % TMA_ALIGN == 0 and t.stride(0) * t.element_size() % TMA_ALIGN == 0
               for t in (x, weight)):
        return False
    return INTERPRETED or hopper_or_later(x)


def takes_tma(rows: int) -> bool:
    """Whether the served frame's folded products of this many rows take the kernel (``TMA_MIN_ROWS`` ..)."""
    return TMA_MIN_ROWS <= rows <= TMA_MAX_ROWS


def wide_blocks(rows: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages): the tile probe's best for the predictor's qkv and gate/up at 64 rows
    (tma_probe.py): one 64-row block of thin column blocks (128 programs for qkv) with five K steps of 128 in
    flight; 128-row blocks with three past 64 rows; fp32 operands (tests) two stages (shared memory)."""
    block_m, stages = (64, 5) if rows <= 64 else (128, 3)
    return block_m, 32, 128, 2 if element_size > 2 else stages


def wide_linear(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False,
                input_norm: tuple[torch.Tensor, int, float] | None = None, tma: bool = True) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] (gated: weight [2N, K], gate rows then up rows -> silu(gate) * up).

    ``input_norm`` = (squares [blocks, M] float32, size, eps): weight has an RMSNorm's weight folded in and each
    row is scaled by ``rsqrt(sum(squares[:, row]) / size + eps)`` (``small_linear(row_squares=True)``'s output).
    ``tma=False`` (the served frame: unless ``takes_tma``) or operands ``tma_ready`` refuses: cuBLAS, then
    ``silu_and_mul``."""
    rows, depth = x.shape
    cols = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight.shape[1] != depth:
        raise ValueError(f"wide_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
    if input_norm is not None and not gated:
        raise ValueError("wide_linear applies input_norm in the gated epilogue only (the attention scales qkv)")
    if not (tma and tma_ready(x, weight)):
        out = F.linear(x, weight)
        return silu_and_mul(out, input_norm=input_norm) if gated else out
    squares, norm_size, eps, square_blocks = checked_input_norm(input_norm, rows, x, "wide_linear")
    block_m, block_n, block_k, stages = wide_blocks(rows, x.element_size())
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    pdl = enabled_for(x)
    _wide_linear_kernel[(triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        weight, out, squares, rows, cols, depth, out.stride(0), weight.stride(0),
        square_blocks, norm_size, eps, GATED=gated, INPUT_NORM=input_norm is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SQUARE_BLOCK=square_block(square_blocks),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
        PREFETCH_LINES=prefetch_lines(depth, weight.element_size()), num_warps=4, launch_pdl=pdl)
    return out
