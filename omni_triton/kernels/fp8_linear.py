"""Linear layers with block-FP8 weights (``models.quantization``): ``x @ dequant(W).T (+ bias)`` reading W as FP8.

Two schemes, one kernel body:

- w8a16 (the default): each [BLOCK_K, BLOCK_N] weight tile is loaded as FP8, multiplied by its block's scales in
  fp32 and rounded to the activations' dtype, then a ``tl.dot`` with the bf16 activations into an fp32 accumulator:
  the product the torch path computes with the dequantized weight (``layers.fp8.Fp8Linear``), reading half the
  weight bytes. BLOCK_K divides the block's columns, so every K tile has one scale per output column.
- w8a8 (``act_quant=True``, the checkpoint's ``activation_scheme: dynamic``): the activations are first quantized
  per row and per block of columns (``quantize_act_groups``: one fp32 scale per row and group, the group the
  weight block's width), then the tiles are multiplied as FP8 (``tl.dot`` of e4m3 operands: Hopper's FP8 tensor
  cores) and each K tile's partial sum is scaled by the row's and the column's scales before it joins the fp32
  accumulator (so the tensor cores' reduced-precision accumulation never runs past one block).

Rows are padded to BLOCK_M = 16 (the smallest ``tl.dot``) at a decode step's few rows; the product is
bandwidth-bound there and reads W once per column tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous

FP8_MAX = 448.0


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
def _fp8_linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, depth,
                       stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACT_QUANT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = row < rows, col < cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + col[None, :].to(tl.int64) * stride_wn + ks[:, None]
    w_scale_ptrs = w_scale_ptr + (col // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + row[:, None].to(tl.int64) * stride_om + col[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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
               bias: torch.Tensor | None = None, *, act_quant: bool = False) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/b0),
    ceil(K/b1)]).T (+ bias [N]) -> [..., N] in x's dtype. ``act_quant``: w8a8 with dynamic activation scales
    per row and group of ``block[1]`` columns (see the module docstring)."""
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
    x_scales = None
    if act_quant:
        x2, x_scales = quantize_act_groups(x2, block[1])
    block_m = 16 if rows <= 16 else (32 if rows <= 64 else 64)
    block_n = 64 if rows <= 64 else 128
    pdl = enabled_for(x)
    _fp8_linear_kernel[(triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))](
        x2, x_scales if act_quant else x2, weight, weight_scale_inv, bias if bias is not None else out, out,
        rows, cols, depth, x2.stride(0), x_scales.stride(0) if act_quant else 0, weight.stride(0),
        weight_scale_inv.stride(0), out.stride(0), BLOCK_ROWS=block[0], BLOCK_COLS=block[1], ACT_QUANT=act_quant,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3, PDL=pdl,
        launch_pdl=pdl)
    return out.reshape(*lead, cols)
