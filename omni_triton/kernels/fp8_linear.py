"""Linear layers with block-FP8 weights (``models.quantization``): ``x @ dequant(W).T (+ bias)`` reading W as FP8.

Two schemes, one tiled kernel body (and, below, the launches for a decode step's few rows):

- w8a16 (the default): each [BLOCK_K, BLOCK_N] weight tile is loaded as FP8, multiplied by its block's scales in
  fp32 and rounded to the activations' dtype, then a ``tl.dot`` with the bf16 activations into an fp32 accumulator:
  the product the torch path computes with the dequantized weight (``layers.fp8.Fp8Linear``), reading half the
  weight bytes. BLOCK_K divides the block's columns, so every K tile has one scale per output column.
- w8a8 (``act_quant=True``, the checkpoint's ``activation_scheme: dynamic``): the activations are first quantized
  per row and per block of columns (``quantize_act_groups``: one fp32 scale per row and group, the group the
  weight block's width), then the tiles are multiplied as FP8 (``tl.dot`` of e4m3 operands: Hopper's FP8 tensor
  cores) and each K tile's partial sum is scaled by the row's and the column's scales before it joins the fp32
  accumulator (so the tensor cores' reduced-precision accumulation never runs past one block).

A decode step's few rows (``small_rows``, as ``fast_kernels.step_linear`` picks bf16's small-row kernels) are
bandwidth-bound: what counts is how many weight bytes are in flight, and a 64-column tile per program (64
programs for the thinker's q, 32 for its o_proj, 8 for its k or v alone) left most of HBM idle. So, w8a16:

- up to ``GEMV_ROWS`` (two) rows (``kernels.small_linear``'s, where its multiply-add GEMV beat split-K), a
  GEMV: 2-8 output columns a program over the whole K (a compile-time constant: the loop unrolls and every weight
  load issues at once), ~512 programs, each FP8 chunk dequantized in registers with its block scales, rounded to
  the activations' dtype as the torch path rounds, multiplied and summed in fp32 per row;
- up to ``SMALL_MAX_ROWS`` rows (w8a8 too), the tiled kernel with its rows padded to one 16-row tile and K cut
  into slices as well (``small_linear``'s split plan: ~512 programs), each slice's fp32 partials summed in split
  order by the program that arrives last (the same bits whoever it is), which adds the bias and stores.

More rows: the tiled kernel in one pass, 16-64 rows a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, prefetch_lines, wait_for_previous
from omni_triton.kernels.scratch import persistent_zeros
from omni_triton.kernels.small_linear import GEMV_MAX_ROWS, block_sizes, gemv_blocks, prefetch_weight_slice, split_plan

FP8_MAX = 448.0
SMALL_MAX_ROWS = 16  # up to here ``small_rows`` takes the GEMV or the split tiled kernel (a decode step's rows)
GEMV_ROWS = min(GEMV_MAX_ROWS, 2)  # the GEMV's rows: as bf16's, and its accumulators hold two
# Weights a GEMV program holds per (unrolled) chunk: compiled for sm_90 at two rows, 2048 took 64-69 registers a
# thread (4 warps), 4096 took 144
GEMV_CHUNK = 2048


def k_tile(block_cols: int) -> int:
    """The K tile: the largest power of two <= 128 dividing the block's width (at least 16, ``tl.dot``'s)."""
    tile = 128
    while tile >= 16:
        if block_cols % tile == 0:
            return tile
        tile //= 2
    raise ValueError(f"FP8 block width {block_cols} is not a multiple of 16: no kernel tile fits it")


def supports(block: tuple[int, int]) -> bool:
    return block[1] % 16 == 0


@triton.jit
def _fp8_linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, rows,
                       cols, depth, k_per_split, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACT_QUANT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = row < rows, col < cols
    k_start = tl.program_id(2) * k_per_split  # slices are whole BLOCK_K steps: ``ks < depth - k0`` masks the last
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None].to(tl.int64) * stride_xm + k_start + ks[None, :]
    w_ptrs = w_ptr + col[None, :].to(tl.int64) * stride_wn + k_start + ks[:, None]
    w_scale_ptrs = w_scale_ptr + (col // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(depth, k_start + k_per_split), BLOCK_K):
        k_mask = ks < depth - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        w_scale = tl.load(w_scale_ptrs + k0 // BLOCK_COLS, mask=col_mask, other=0.0)
        if ACT_QUANT:
            a_scale = tl.load(x_scale_ptr + row * stride_xsm + k0 // BLOCK_COLS, mask=row_mask, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        else:
            w = (w.to(tl.float32) * w_scale[None, :]).to(a.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLITS > 1:
        last, acc = _sum_of_splits(acc, partial_ptr, counter_ptr, row[:, None] * cols + col[None, :],
                                   row_mask[:, None] & col_mask[None, :], rows * cols, SPLITS)
        if last:
            _store_tile(acc, bias_ptr, out_ptr, row, col, row_mask, col_mask, stride_om, HAS_BIAS)
    else:
        _store_tile(acc, bias_ptr, out_ptr, row, col, row_mask, col_mask, stride_om, HAS_BIAS)


@triton.jit
def _sum_of_splits(acc, partial_ptr, counter_ptr, at, mask, slot_size, SPLITS: tl.constexpr):
    """Split-K: stores this program's fp32 partials (``partial_ptr[split, row, col]``, through L2 only: another
    SM's L1 may hold an earlier call's values there) and takes its tile's ticket. Returns (whether it came last,
    then the slices' partials summed in split order). The last puts the ticket back to 0 for the next call."""
    tl.store(partial_ptr + tl.program_id(2) * slot_size + at, acc, mask=mask, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's partials stored before the ticket releases them
    tile = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    last = tl.atomic_add(tile, 1, sem="acq_rel") == SPLITS - 1
    total = tl.zeros_like(acc)
    if last:
        for split in tl.static_range(SPLITS):  # unrolled: every slice's load in flight at once
            total += tl.load(partial_ptr + split * slot_size + at, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(tile, 0)
    return last, total


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, row, col, row_mask, col_mask, stride_om, HAS_BIAS: tl.constexpr):
    """The fp32 sums (+ bias), rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + row[:, None].to(tl.int64) * stride_om + col[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, cols, stride_xm, stride_wn, stride_wsn, stride_om,
                     K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPAN: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    """w8a16 for one or two rows: multiply-adds, no MMA tile. BLOCK_N output columns a program over the whole K, in
    chunks of [BLOCK_N, GROUPS * SPAN] weights (SPAN divides the block's width: one scale per column and group,
    ``group_scales``). The products are summed elementwise per row and reduced across the threads once at the end;
    x is loaded in the chunk's own shape (each column's copy from L1), so the product needs no exchange of registers
    between threads (the sm_90 compile of a row-broadcast x moved it through shared memory on every chunk). The
    chunk stays two-dimensional: how Triton lays out a [columns, groups, span] tile depends on its version (3.6 put
    warps across the groups and loaded each broadcast scale once per weight a thread holds)."""
    col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = col < cols
    prefetch_weight_slice(w_ptr, col, col_mask, 0, K, cols, stride_wn, False, PDL, PREFETCH_LINES)
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    ks = tl.arange(0, GROUPS * SPAN)[None, :]
    w_rows = w_ptr + col[:, None].to(tl.int64) * stride_wn
    w_scale_rows = w_scale_ptr + (col // BLOCK_ROWS) * stride_wsn
    chunk_shape = tl.zeros([BLOCK_N, 1], dtype=tl.int32)  # x broadcast over the columns: loaded in their layout
    acc = tl.zeros([BLOCK_N, GROUPS * SPAN], dtype=tl.float32)
    acc_second = tl.zeros([BLOCK_N, GROUPS * SPAN], dtype=tl.float32)
    for k0 in tl.static_range(0, K, GROUPS * SPAN):  # K a compile-time constant: unrolled, every load issued at once
        kk = k0 + ks
        k_mask = kk < K
        w = tl.load(w_rows + kk, mask=col_mask[:, None] & k_mask, other=0.0)
        w_scale = group_scales(w_scale_rows, col_mask, k0, K, BLOCK_N, BLOCK_COLS, GROUPS, SPAN)
        # the torch path's weight: dequantized in fp32, rounded once to the activations' dtype
        w = (w.to(tl.float32) * w_scale).to(dtype).to(tl.float32)
        x_mask = k_mask & (chunk_shape == 0)
        acc += w * tl.load(x_ptr + kk + chunk_shape, mask=x_mask, other=0.0).to(tl.float32)
        if TWO_ROWS:
            acc_second += w * tl.load(x_ptr + stride_xm + kk + chunk_shape, mask=x_mask, other=0.0).to(tl.float32)
    _store_row(tl.sum(acc, axis=1), bias_ptr, out_ptr, col, col_mask, HAS_BIAS)
    if TWO_ROWS:
        _store_row(tl.sum(acc_second, axis=1), bias_ptr, out_ptr + stride_om, col, col_mask, HAS_BIAS)


@triton.jit
def group_scales(scale_rows, row_mask, k0, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_COLS: tl.constexpr,
                 GROUPS: tl.constexpr, SPAN: tl.constexpr):
    """[BLOCK_N, GROUPS * SPAN]: the block scale of each weight of a chunk of BLOCK_N rows (``scale_rows``: [BLOCK_N]
    pointers to their rows of block scales) from column k0, loaded once per row and group (SPAN divides the block's
    width) and repeated over the group's SPAN columns."""
    group_start = k0 + tl.arange(0, GROUPS)[None, :] * SPAN
    scale = tl.load(scale_rows[:, None] + group_start // BLOCK_COLS, mask=row_mask[:, None] & (group_start < K),
                    other=0.0)
    return tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, GROUPS, SPAN]), [BLOCK_N, GROUPS * SPAN])


@triton.jit
def _store_row(out, bias_ptr, out_ptr, col, col_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        out += tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + col, out.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, depth, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr, FP8_LIMIT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row, group = tl.program_id(0), tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)
    mask = ks < depth
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / FP8_LIMIT, 1.0)
    q = tl.clamp(x / scale, -FP8_LIMIT, FP8_LIMIT)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + group, scale)


def quantize_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, ceil(K / group)]): each row's groups of ``group``
    columns scaled so that their largest magnitude is FP8's largest (``x ~ q * scale``)."""
    rows, depth = x.shape
    groups = triton.cdiv(depth, group)
    quantized = torch.empty(rows, depth, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    pdl = enabled_for(x)
    _quantize_groups_kernel[(rows, groups)](x, quantized, scales, depth, x.stride(0), quantized.stride(0),
                                            scales.stride(0), GROUP=group, FP8_LIMIT=FP8_MAX, PDL=pdl,
                                            launch_pdl=pdl)
    return quantized, scales


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, *, act_quant: bool = False, small_rows: bool = True) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/b0),
    ceil(K/b1)]).T (+ bias [N]) -> [..., N] in x's dtype. ``act_quant``: w8a8 with dynamic activation scales
    per row and group of ``block[1]`` columns. ``small_rows``: up to ``SMALL_MAX_ROWS`` rows the small-row
    launches (off: the tiled kernel in one pass at every row count; see the module docstring)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8_linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    lead, depth = x.shape[:-1], x.shape[-1]
    cols = weight.shape[0]
    if weight.shape[1] != depth or weight.stride(1) != 1:
        raise ValueError(f"fp8_linear: x has {depth} features, the weight {tuple(weight.shape)} (contiguous rows)")
    x2 = x.reshape(-1, depth)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.reshape(*lead, cols)
    block_k = k_tile(block[1])
    bias_arg = bias if bias is not None else out
    pdl = enabled_for(x)
    if small_rows and not act_quant and rows <= GEMV_ROWS:
        block_n, groups = gemv_chunk(rows, cols, depth, block_k)
        _fp8_gemv_kernel[(triton.cdiv(cols, block_n),)](
            x2, weight, weight_scale_inv, bias_arg, out, cols, x2.stride(0), weight.stride(0),
            weight_scale_inv.stride(0), out.stride(0), K=depth, BLOCK_ROWS=block[0], BLOCK_COLS=block[1],
            HAS_BIAS=bias is not None, TWO_ROWS=rows == 2, BLOCK_N=block_n, GROUPS=groups, SPAN=block_k, PDL=pdl,
            PREFETCH_LINES=prefetch_lines(depth, weight.element_size()), num_warps=4, launch_pdl=pdl)
        return out.reshape(*lead, cols)
    x_scales = None
    if act_quant:
        x2, x_scales = quantize_act_groups(x2, block[1])
    (block_m, block_n, block_k), splits, k_per_split = tiled_plan(rows, cols, depth, block_k, small_rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), splits)
    partials = counters = out  # unread placeholders of a launch in one pass
    if splits > 1:  # partials: the call's own (a CUDA graph's pool under capture); tickets kept at 0 between calls
        partials = torch.empty(splits * rows * cols, dtype=torch.float32, device=x.device)
        counters = persistent_zeros("fp8_linear", x.device, torch.int32, grid[0] * grid[1])
    _fp8_linear_kernel[grid](
        x2, x_scales if act_quant else x2, weight, weight_scale_inv, bias_arg, out, partials, counters,
        rows, cols, depth, k_per_split, x2.stride(0), x_scales.stride(0) if act_quant else 0, weight.stride(0),
        weight_scale_inv.stride(0), out.stride(0), BLOCK_ROWS=block[0], BLOCK_COLS=block[1], ACT_QUANT=act_quant,
        HAS_BIAS=bias is not None, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3, PDL=pdl,
        launch_pdl=pdl)
    return out.reshape(*lead, cols)


def gemv_chunk(rows: int, cols: int, depth: int, span: int) -> tuple[int, int]:
    """(BLOCK_N, GROUPS) of the GEMV: ``small_linear``'s 2-8 columns a program (~512 programs), and as many
    ``span``-wide groups of K as make a chunk of about ``GEMV_CHUNK`` weights (no more than K needs)."""
    block_n = gemv_blocks(rows, cols, depth)[1]
    groups = max(1, min(GEMV_CHUNK // block_n, triton.next_power_of_2(depth)) // span)
    return block_n, groups


def tiled_plan(rows: int, cols: int, depth: int, block_k: int, small_rows: bool
               ) -> tuple[tuple[int, int, int], int, int]:
    """((BLOCK_M, BLOCK_N, BLOCK_K), splits, K per split) of the tiled kernel. ``small_rows`` up to
    ``SMALL_MAX_ROWS`` rows: ``small_linear``'s tile (16 rows, 16-32 columns) and split plan (~512 programs), its
    K step cut to ``block_k`` (inside one scale block); otherwise one pass with 16-64 rows by 64-128 columns."""
    if small_rows and rows <= SMALL_MAX_ROWS:
        block_m, block_n, step = block_sizes(rows, cols, depth)
        blocks = (block_m, block_n, min(step, block_k))
        return (blocks, *split_plan(rows, cols, depth, blocks, norm=False, gated=False))
    blocks = (16 if rows <= 16 else (32 if rows <= 64 else 64), 64 if rows <= 64 else 128, block_k)
    return blocks, 1, depth
