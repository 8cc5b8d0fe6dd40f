"""A linear layer for few rows (M <= ~128) with its neighbours fused in: one launch instead of two or three.

    small_linear(x, W)                               x @ W.T
    small_linear(x, W, norm_weight=w, eps=e)         RMSNorm(x) @ W.T          (the pre-norm of a block)
    small_linear(x, W, gated=True)                   silu(x @ Wg.T) * (x @ Wu.T), W = [Wg; Wu] packed
    small_linear(x, W, residual=r)                   r + x @ W.T               (the residual add after it)
    small_linear(x, W, ..., cublas=True)             many rows of a wide output: cuBLAS (library_linear)

Made for the code predictor (hidden 1024, heads 16/8 x 128, MLP 3072, 2048 codes; 1..64 rows per step, 2x
that in the frame's first step), whose 15 steps per frame are weight-read bound: every step streams all
~150 MB of its weights for a handful of rows. So the grid spreads the *output columns* over as many programs
as it can (``BLOCK_N`` 16 or 32; one program per column block and row block) so that each reads a thin slice
of W once, pipelined over K in ``BLOCK_K`` steps; the rows are padded to ``BLOCK_M`` >= 16 (the smallest
``tl.dot`` tile) and the wasted MMA work is free at this arithmetic intensity. The normalised input is
recomputed by each program (x is a few KB), which costs nothing next to its W slice.

Split-K (``split_k``, default: as ``split_plan`` picks): column blocks alone are only 64-128 programs on a
132-SM GPU, too few weight bytes in flight (a fraction of HBM bandwidth), so K is cut into
slices as well, one program per (column block, row block, K slice), all in ONE launch. Each program writes
its fp32 partial sums to a scratch buffer, then takes a ticket from its tile's counter; the one that arrives
last adds the partials up in split order (so the result does not depend on who arrives last: the same inputs
give the same bits on every call), applies the epilogue and resets the counter to 0 for the next call. The
scratch and counters are made once per (device, size) by the first call and reused, so calls are CUDA-graph
capturable once a shape has run eagerly; one stream at a time may use them (calls on one stream are ordered).
``split_k=1`` is the one-pass kernel (the configuration before split-K).

cuBLAS for many rows of a wide output (``cublas=True``: the served launch): from ``CUBLAS_MIN_ROWS`` rows on, an
output of ``CUBLAS_MIN_COLS`` columns or more without a residual (the predictor's qkv, gate/up and lm_head) runs as
the norm kernel, cuBLAS's GEMM and the activation kernel: three launches that beat the one fused launch there (the
fused MMA tile reaches a fraction of HBM bandwidth at 32-128 rows; from 32 rows cuBLAS won, at 1 row it lost, at
8-16 rows even: docs/performance.md). Outputs with
a residual (o, down) keep the fused kernel: moving them to cuBLAS as well was slower at every row count.

Roundings follow the torch modules (``models.layers.norm.RMSNorm``, ``GatedMLP``, the residual adds of
``DecoderLayer``): the normalised row to the input dtype before the weight, the product to the input dtype,
each GEMM output to the input dtype, then the activation, its product with up, and the residual sum, each
rounded. Only the accumulation order of the dot products differs from cuBLAS (and between split counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from omni_triton.kernels.activation import silu_and_mul, silu_times
from omni_triton.kernels.dependent_launch import enabled_for, prefetch_l2, prefetch_lines, wait_for_previous
from omni_triton.kernels.norm import rms_norm
from omni_triton.kernels.scratch import persistent_zeros

# Programs one launch should have for the weight reads to fill HBM: ~4 per SM of a 132-SM Hopper GPU, which fit on
# an SM at once (compiled for sm_90, the split programs of the predictor's layers take 48-128 registers a
# thread and 28-45 KB of shared memory), so one wave keeps ~8-32 KB of W per program, several MB in all, in
# flight.
TARGET_PROGRAMS = 512
# More rows than this keep the one-pass kernel: splitting the predictor's o/down projections at 64-128 rows made
# them slower (their tiles are enough programs already; benchmarks/small_linear_bench.py)
SPLIT_MAX_ROWS = 32
WIDE_SPLIT_MAX_ROWS = 2  # outputs wider than NARROW_COLS split up to here only (launch_plan)
NARROW_COLS = 1024  # the predictor's o/down projections: thin column blocks (block_sizes)


@triton.jit
def _small_linear_kernel(x_ptr, w_ptr, out_ptr, norm_weight_ptr, residual_ptr, partial_ptr, counter_ptr,
                         squares_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_rm, eps,
                         NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                         SQUARES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NORM_BLOCK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                         PREFETCH_LINES: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(2) * k_per_split  # slices are whole BLOCK_K steps, so ``kk < K`` masks the last one
    prefetch_weight_slice(w_ptr, cols, col_mask, k_start, tl.minimum(K, k_start + k_per_split), N, stride_wn,
                           GATED, PDL, PREFETCH_LINES)
    wait_for_previous(PDL)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # first pass over the whole row (every K slice needs it): its mean square
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            kk = k0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
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
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLITS > 1:
        # partials [split, gate/up, M, N] in fp32, through L2 only (.cg: another SM's L1 may hold a previous
        # call's values at these addresses)
        halves: tl.constexpr = 2 if GATED else 1
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        slot = partial_ptr + tl.program_id(2) * (halves * M * N)  # < 2**31: scratch is MBs
        tl.store(slot + at, acc, mask=out_mask, cache_modifier=".cg")
        if GATED:
            tl.store(slot + M * N + at, acc_up, mask=out_mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partials stored before the ticket releases them to the last program
        tile = counter_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(tile, 1, sem="acq_rel") == SPLITS - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            # in split order, whoever came last: deterministic; unrolled, so that the loads are all in flight
            # at once rather than one L2 round trip per split
            for split in tl.static_range(SPLITS):
                slot = partial_ptr + split * (halves * M * N)
                acc += tl.load(slot + at, mask=out_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(slot + M * N + at, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_output(acc, acc_up, out_ptr, residual_ptr, squares_ptr, M, rows, cols, out_mask, stride_om,
                          stride_rm, dtype, GATED, RESIDUAL, SQUARES)
            tl.store(tile, 0)  # every split has counted: ready for the next call (and graph replay)
    else:
        _store_output(acc, acc_up, out_ptr, residual_ptr, squares_ptr, M, rows, cols, out_mask, stride_om,
                      stride_rm, dtype, GATED, RESIDUAL, SQUARES)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, norm_weight_ptr, residual_ptr, M, N, stride_xm, stride_wn, stride_om,
                 stride_rm, eps, K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH_LINES: tl.constexpr):
    """Few rows: multiply-adds on the CUDA cores, no MMA tile. Each program owns BLOCK_N output columns over the
    whole K; K is a compile-time constant, so the K loop unrolls and every chunk's weight load is issued before
    the first one is used: one memory round trip per program, with hundreds of programs in one wave."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    ks = tl.arange(0, BLOCK_K)
    prefetch_weight_slice(w_ptr, cols, col_mask, 0, K, N, stride_wn, GATED, PDL, PREFETCH_LINES)
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :],
                        other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + ks
        k_mask = kk < K
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_cols + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if GATED:
            w_up = tl.load(w_cols + N * stride_wn + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if NORM:
            weight = tl.load(norm_weight_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            # rows past M (padding to BLOCK_M) re-read the last row: never stored
            a = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + kk, mask=k_mask, other=0.0)
            if NORM:
                rstd_m = tl.sum(tl.where(rows == m, rstd, 0.0), axis=0)
                a = (weight * (a.to(tl.float32) * rstd_m).to(dtype).to(tl.float32)).to(dtype)
            a = a.to(tl.float32)
            at_m = (rows == m)[:, None]
            acc = tl.where(at_m, acc + tl.sum(w * a[None, :], axis=1)[None, :], acc)
            if GATED:
                acc_up = tl.where(at_m, acc_up + tl.sum(w_up * a[None, :], axis=1)[None, :], acc_up)
    _store_output(acc, acc_up, out_ptr, residual_ptr, out_ptr, M, rows, cols, row_mask[:, None] & col_mask[None, :],
                  stride_om, stride_rm, dtype, GATED, RESIDUAL, False)


@triton.jit
def prefetch_weight_slice(w_ptr, cols, col_mask, k_begin, k_end, N, stride_wn, GATED: tl.constexpr,
                           PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    """This program's W rows (and their up half) over K in [k_begin, k_end), into L2 while the previous kernel
    still runs (``kernels.dependent_launch``): one prefetch per 128-byte line."""
    if PDL:
        line_elements: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # 128 bytes
        lines = k_begin + tl.arange(0, PREFETCH_LINES) * line_elements
        ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + lines[None, :]
        mask = col_mask[:, None] & (lines < k_end)[None, :]
        prefetch_l2(ptrs, mask, w_ptr, PDL)
        if GATED:
            prefetch_l2(ptrs + N * stride_wn, mask, w_ptr, PDL)


@triton.jit
def _store_output(acc, acc_up, out_ptr, residual_ptr, squares_ptr, M, rows, cols, out_mask, stride_om, stride_rm,
                  dtype: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, SQUARES: tl.constexpr):
    """The epilogue on the fp32 sums: rounded to x's dtype, gated and residual-added as the modules round; under
    SQUARES the sum of the stored row's squares over this column block, for the next pre-norm
    (``squares_ptr[column block, row]``)."""
    out = acc.to(dtype)
    if GATED:
        out = silu_times(out.to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    if RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=out_mask,
                           other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=out_mask)
    if SQUARES:
        stored = out.to(tl.float32)
        tl.store(squares_ptr + tl.program_id(0) * M + rows, tl.sum(tl.where(out_mask, stored * stored, 0.0), axis=1),
                 mask=rows < M)


def block_sizes(rows: int, cols: int, depth: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a split call (one pass: ``one_pass_blocks``): rows padded to a dot tile
    (16..64); column blocks of 16 for narrow outputs (the predictor's o/down projections, N=1024: 64 programs)
    with K steps of 256, so each program keeps as many weight bytes in flight as a wide one; column blocks of 32
    and K steps of 128 for wide outputs (qkv 4096, gate/up 3072, lm_head 2048: 64-128 programs)."""
    narrow = cols <= NARROW_COLS
    block_k = min(256 if narrow else 128, max(16, triton.next_power_of_2(depth)))
    return min(64, max(16, triton.next_power_of_2(rows))), 16 if narrow else 32, block_k


def split_plan(rows: int, cols: int, depth: int, block_sizes_: tuple[int, int, int], norm: bool, gated: bool,
               split_k: int | None = None) -> tuple[int, int]:
    """(splits, K per split, a whole number of BLOCK_K steps) for an [rows, depth] x [cols, depth] product.

    Splits bring the launch to ~``TARGET_PROGRAMS`` (tiles x splits), capped where a split costs more than it
    brings: each adds its fp32 partials (written and read back through L2: 8 x rows x cols bytes) and, under a
    norm, a re-read of all of x (rows x depth) by every program, both kept within the weight bytes. The
    predictor at 1-2 rows: qkv 4 splits, o 8, gate/up 4, down 6, lm_head 8 (384-512 programs); at 64 rows the
    norm layers stay at one pass. ``split_k`` forces a count instead (1: the one-pass kernel)."""
    block_m, block_n, block_k = block_sizes_
    steps = triton.cdiv(depth, block_k)
    if split_k is None:
        tiles = triton.cdiv(cols, block_n) * triton.cdiv(rows, block_m)
        split_k = max(1, TARGET_PROGRAMS // tiles) if rows <= SPLIT_MAX_ROWS else 1
        split_k = min(split_k, max(1, depth // (4 * rows)))  # partials 2 x 4 bytes/row/col <= 2-byte weights
        if norm:  # x re-read tiles x splits x rows x depth <= weights (1 or 2) x cols x depth
            split_k = min(split_k, max(1, (2 if gated else 1) * cols // (tiles * rows)))
    steps_per_split = triton.cdiv(steps, max(1, min(split_k, steps)))
    return triton.cdiv(steps, steps_per_split), steps_per_split * block_k


def one_pass_blocks(rows: int, cols: int, depth: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a call that does not split: K steps of 256, which the tile sweep
    (``small_linear_bench.py --sweep-tiles``, 16-128 rows) found fastest for every predictor layer: fewer K steps
    hide more of each load; columns as ``block_sizes``."""
    block_m, block_n, _ = block_sizes(rows, cols, depth)
    return block_m, block_n, min(256, max(16, triton.next_power_of_2(depth)))


def launch_plan(rows: int, cols: int, depth: int, norm: bool, gated: bool, split_k: int | None = None,
                element_size: int = 2) -> tuple[tuple[int, int, int], int, int, int]:
    """(blocks, splits, K per split, num_stages) of the MMA kernels for one call.

    Wide outputs (qkv, gate/up, lm_head) split only at 1-2 rows: from there on their one-pass tile with K steps
    of 256 was faster than split-K (enough programs from the rows and columns alone);
    narrow ones (o, down: 64 column blocks) keep the split plan up to ``SPLIT_MAX_ROWS``."""
    blocks = block_sizes(rows, cols, depth)
    if split_k is None and cols > NARROW_COLS and rows > WIDE_SPLIT_MAX_ROWS:
        split_k = 1
    splits, k_per_split = split_plan(rows, cols, depth, blocks, norm, gated, split_k)
    if splits == 1:
        blocks = one_pass_blocks(rows, cols, depth)
        _, k_per_split = split_plan(rows, cols, depth, blocks, norm, gated, 1)
    return blocks, splits, k_per_split, num_stages(element_size, blocks[0], splits, cols)


def num_stages(element_size: int, block_m: int, splits: int, cols: int) -> int:
    """Pipeline stages of the MMA kernels. fp32 tiles: 2 (twice the shared memory). One pass: the tile
    sweep's best, 4 for the narrow layers' thin tiles, 3 for the wide ones. Split: 3 (two K steps' loads in
    flight from the start: a split's whole slice at 1-2 steps), unless that costs occupancy: a split program of
    64 rows at 3 stages (a 64 x 256 x tile: 120 KB) would be alone on its SM, where split-K wants several."""
    if element_size > 2:
        return 2
    if splits == 1:
        return 4 if cols <= NARROW_COLS else 3
    return 2 if block_m > 32 else 3


# Up to here ``gemv=True`` runs the multiply-add kernel: it beat split-K at 1-2 rows (no scratch round trip) and
# lost from 8 (each row's products are reduced across the threads again)
GEMV_MAX_ROWS = 2
GEMV_MIN_PROGRAMS = 512  # column blocks thin enough for about this many programs (~4 per SM: measured best)


def gemv_blocks(rows: int, cols: int, depth: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the multiply-add kernel: 2-8 columns a program, so that a launch has about
    ``GEMV_MIN_PROGRAMS`` programs, each holding its whole K slice of W in registers (~4K elements a chunk)."""
    block_n = max(2, min(8, 1 << max(0, (cols // GEMV_MIN_PROGRAMS).bit_length() - 1)))
    block_k = min(triton.next_power_of_2(depth), max(16, 4096 // block_n))
    return triton.next_power_of_2(rows), block_n, block_k


# (K, N, gated) -> (BLOCK_N, BLOCK_K, num_warps) of the GEMV at 1-2 rows where another launch shape than
# ``gemv_blocks``' rule with 4 warps measured faster (benchmarks/gemv_sweep.py at one row; docs/performance.md):
# the thinker's qkv and o_proj, the predictor's qkv and gate/up. Every other shape keeps the rule.
GEMV_TUNED = {(2048, 5120, False): (8, 1024, 8), (4096, 2048, False): (2, 4096, 8),
              (1024, 4096, False): (8, 1024, 4), (1024, 3072, True): (8, 1024, 4)}


def gemv_launch(rows: int, cols: int, depth: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the multiply-add kernel: ``GEMV_TUNED``'s entry, else the rule."""
    block_m, block_n, block_k = gemv_blocks(rows, cols, depth)
    block_n, block_k, warps = GEMV_TUNED.get((depth, cols, gated), (block_n, block_k, 4))
    return block_m, block_n, block_k, warps


def workspace(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The split-K scratch (float32 partials) or tile counters (int32, zeroed; the kernel leaves them 0) of
    this size on ``device`` (``kernels.scratch``: made once, reused by every later call and graph replay)."""
    return persistent_zeros("small_linear", device, dtype, numel)


# ``cublas=True``: outputs this wide without a residual, at this many rows or more, go to ``library_linear``
# (benchmarks/results/h200-predictor-cublas/: the predictor's 15 steps at 8-128 rows)
CUBLAS_MIN_ROWS = 8
CUBLAS_MIN_COLS = 2048


def takes_cublas(rows: int, cols: int, residual: bool) -> bool:
    """Whether a ``cublas=True`` call of this shape runs ``library_linear`` (the default plan only)."""
    return rows >= CUBLAS_MIN_ROWS and cols >= CUBLAS_MIN_COLS and not residual


def library_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                   gated: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``small_linear`` without a residual as three library-grade launches: the norm kernel, cuBLAS's GEMM, the
    activation kernel; each rounds to x's dtype where the torch modules do (the same as the fused kernel)."""
    out = F.linear(x if norm_weight is None else rms_norm(x, norm_weight, eps), weight)
    if gated:
        out = silu_and_mul(out)
    return out if out_dtype is None else out.to(out_dtype)


def small_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, split_k: int | None = None, gemv: bool = False,
                 cublas: bool = False, tile: tuple[int, int, int, int, int] | None = None,
                 row_squares: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any row stride), weight [N, K] ([2N, K]: gate rows then up rows when ``gated``) -> [M, N].

    The result is rounded to x's dtype (as the torch layer's output is) and stored as ``out_dtype`` (default
    x's dtype; float32 for logits). ``split_k``: K slices per output tile (None: ``split_plan``'s choice; 1:
    the one-pass kernel). ``gemv``: up to ``GEMV_MAX_ROWS`` rows, the multiply-add kernel instead (more rows:
    as ``split_k`` says). ``cublas``: shapes ``takes_cublas`` picks run ``library_linear`` (unless ``split_k`` or
    ``tile`` force a kernel launch). ``tile``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the MMA kernels instead
    of ``block_sizes``' (benchmarks/small_linear_bench.py --sweep-tiles).

    ``row_squares``: returns (out, squares ``[column blocks, M]`` float32), each column block's sum of the stored
    rows' squares: the statistics of the next RMSNorm when its weight is folded into the next projection (the code
    predictor's served launch, ``models.code_predictor``; ``silu_and_mul(input_norm=)`` applies it). It runs the
    MMA kernels (not the GEMV)."""
    rows, depth = x.shape
    cols = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != depth:
        raise ValueError(f"small_linear needs contiguous rows and matching K: x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (rows, cols) or residual.stride(1) != 1):
        raise ValueError(f"small_linear residual {tuple(residual.shape)} does not match the output ({rows}, {cols})")
    if split_k is not None and split_k < 1:
        raise ValueError(f"small_linear split_k must be None or >= 1, got {split_k}")
    if (cublas and not row_squares and split_k is None and tile is None
            and takes_cublas(rows, cols, residual is not None)):
        return library_linear(x, weight, norm_weight, eps, gated, out_dtype)
    out = torch.empty(rows, cols, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return (out, torch.zeros(0, 0, dtype=torch.float32, device=x.device)) if row_squares else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = enabled_for(x)
    if gemv and rows <= GEMV_MAX_ROWS and not row_squares:
        block_m, block_n, block_k, warps = gemv_launch(rows, cols, depth, gated)
        _gemv_kernel[(triton.cdiv(cols, block_n),)](
            x, weight, out, x if norm_weight is None else norm_weight, out if residual is None else residual,
            rows, cols, x.stride(0), weight.stride(0), out.stride(0), 0 if residual is None else residual.stride(0),
            eps, K=depth, NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
            PREFETCH_LINES=prefetch_lines(depth, weight.element_size()), num_warps=warps, launch_pdl=pdl)
        return out
    if tile is None:
        blocks, splits, k_per_split, stages = launch_plan(rows, cols, depth, norm_weight is not None, gated, split_k,
                                                          x.element_size())
    else:
        blocks, stages = tile[:3], tile[4]
        splits, k_per_split = split_plan(rows, cols, depth, blocks, norm_weight is not None, gated, split_k)
    grid = (triton.cdiv(cols, blocks[1]), triton.cdiv(rows, blocks[0]), splits)
    # a split program's own K slice is 1-2 steps, so a norm's pass over the whole row, one load round trip per
    # BLOCK_K step, would be most of its latency: it reads x in chunks of up to 8K elements (64 registers a thread)
    norm_block = blocks[2] if splits == 1 else max(blocks[2], min(triton.next_power_of_2(depth), 8192 // blocks[0]))
    partials = counters = out  # unread placeholders of the one-pass kernel
    if splits > 1:
        partials = workspace(x.device, torch.float32, splits * (2 if gated else 1) * rows * cols)
        counters = workspace(x.device, torch.int32, grid[0] * grid[1])
    squares = torch.empty(grid[0], rows, dtype=torch.float32, device=x.device) if row_squares else out
    _small_linear_kernel[grid](
        x, weight, out, x if norm_weight is None else norm_weight, out if residual is None else residual,
        partials, counters, squares, rows, cols, depth, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0), eps,
        NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None, SPLITS=splits, SQUARES=row_squares,
        BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_K=blocks[2], NORM_BLOCK=norm_block,
        PRECISION=precision, PDL=pdl, PREFETCH_LINES=prefetch_lines(k_per_split, weight.element_size()),
        num_warps=4 if tile is None else tile[3], num_stages=stages, launch_pdl=pdl)
    return (out, squares) if row_squares else out
