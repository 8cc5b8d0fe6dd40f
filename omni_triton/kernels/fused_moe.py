"""Fused MoE experts: two grouped-GEMM launches over the expert-sorted layout of ``routing``.

1. gate/up: for every block of ``BLOCK_M`` (token, slot) pairs of one expert, ``x[token] @ gate_up[e].T`` for
   the gate and the up half at once, then ``silu(gate) * up`` -> ``hidden [T * k, I]`` (one row per pair).
2. down: ``hidden[pair] @ down[e].T`` times the pair's router weight -> ``per_pair [T * k, H]``.
At a decode step's 1-2 tokens (``gemv=True``) the two GEMMs run instead as multiply-add GEMVs per (token, slot)
pair over its own expert's weights, a few output columns a program (the layout launch is not needed: each pair
reads its expert id): at one token the grouped gate/up GEMM is a few dozen programs, the per-pair GEMVs 576 for
a talker layer's 6 pairs and 768 for a thinker layer's 8.
The top-k sum is a third, small launch over ``per_pair.view(T, k, H)`` (fusing it into the down GEMM would
need atomics, whose float order changes run to run; torch's ``sum`` took 5 us at decode, this 2). With a shared
expert (the talker) it also adds ``sigmoid(gate) * shared``, three torch launches fewer.

Each expert's weights are read once per block of its pairs: at decode (a few pairs per expert) that is the
weight-read floor. Roundings follow ``models.layers.moe.run_experts`` (the linear outputs, the activation,
its product with up and the router weighting are each rounded to the activation dtype); only the
accumulation order of the dot products and of the top-k sum differ.

FP8 experts (``fp8_scales``: ``layers.fp8.Fp8Experts``' block scales): the same launches read the float8_e4m3fn
weights (w8a16, half the weight bytes). The per-pair GEMVs dequantize each weight with its block's scale, rounded
to the activations' dtype (the weights the torch path's ``Fp8Experts.dequantized`` gives ``run_experts``), loading
a chunk's scales as a [columns, groups] block, a group inside one block of scales (``_fp8_pair_products``): one
scale load per row and group rather than per weight. The grouped GEMMs' K tile lies inside one block of scales,
so each output column has one scale per K tile. With ``SCALE_AFTER_DOT`` (per GEMM in the config; without an
entry, tiles of up to ``SCALE_AFTER_DOT_MAX_ROWS`` rows: a decode step's) the tile goes into ``tl.dot`` as its
exact FP8 values (every e4m3 value is a bf16 / fp16 / fp32 value; bf16 converts without the conversion units,
``_e4m3_as_bf16``) and the [BLOCK_M, BLOCK_N] partial sums are multiplied by the columns' scales in fp32 before
they join the accumulator: a multiply per output instead of per weight (at a decode step's few pairs per expert
the kernel is bound by the instructions spent per weight byte, not by the tensor cores). What that changes in the
roundings: the dequantized weight is never rounded to the activations' dtype (closer to exact; the torch path
rounds each weight * scale to bf16, a relative 2^-9 per weight), and the scale multiplies a K tile's fp32 partial
sum (one more fp32 rounding per tile). Without it, the torch path's rounding: each tile's weights times their
scales in fp32, rounded to the activations' dtype, then the dot (with the dot's own accumulation order, all that
differs from the torch path).

Block sizes come from ``fused_moe_configs.json`` (per device name, per (experts, hidden, intermediate) and weight
format: FP8 experts have their own entries, ``shape_key``; per token-count bucket; written by ``python -m
omni_triton.bench.tune_fused_moe``), else from a size rule.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from omni_triton.kernels.activation import silu_times
from omni_triton.kernels.dependent_launch import INTERPRETED, enabled_for, wait_for_previous
from omni_triton.kernels.fp8_linear import group_scales, k_tile

from omni_triton.kernels.routing import expert_sorted_layout

CONFIG_FILE = Path(__file__).with_name("fused_moe_configs.json")


@triton.jit
def _block_tile(sorted_pairs_ptr, num_pairs, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows (pairs; padding rows are not valid) and output columns."""
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, cols, cols < n_cols


# float8_e4m3fn -> bfloat16, exactly (every finite e4m3 value is a bf16 value), four weights a call: prmt puts each
# byte in the low byte of a 16-bit half with its sign bit repeated over the high byte (selector nibbles 8-b: the
# byte's msb), a shift left by 4 then puts the exponent and mantissa at bf16's bits 4-10 and a sign bit at bit 15,
# and the and keeps those (0x87f0 a half: the sign's other copies and the bits shifted over from the low half go):
# that bf16 is the e4m3 value times 2^-120, subnormals included; one bf16 multiply by 2^120 (0x7b80) a pair makes
# it exact (written as an fma with -0, which sm_80 has too; ptxas emits the multiply). Triton's own conversion
# goes e4m3 -> f16 -> bf16 through the conversion units (an F2F per weight in the sm_90 compile); this is three
# integer instructions and a packed multiply per pair. NaN (0x7f, 0xff) reads +-480.
_E4M3_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 a<2>, bias, neg_zero;
mov.b32 bias, 0x7b807b80;
mov.b32 neg_zero, 0x80008000;
prmt.b32 a0, $2, 0, 0x9180;
prmt.b32 a1, $2, 0, 0xb3a2;
shl.b32 a0, a0, 4;
shl.b32 a1, a1, 4;
and.b32 a0, a0, 0x87f087f0;
and.b32 a1, a1, 0x87f087f0;
fma.rn.bf16x2 $0, a0, bias, neg_zero;
fma.rn.bf16x2 $1, a1, bias, neg_zero;
}
""")


@triton.jit
def _e4m3_as_bf16(w):
    """float8_e4m3fn -> bfloat16 without the conversion units (``_E4M3_TO_BF16_ASM``; not in the interpreter)."""
    return tl.inline_asm_elementwise(_E4M3_TO_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _e4m3_as_bf16_kernel(codes_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, _e4m3_as_bf16(tl.load(codes_ptr + offsets, mask=mask, other=0.0)), mask=mask)


def e4m3_as_bf16(weights: torch.Tensor) -> torch.Tensor:
    """A CUDA float8_e4m3fn tensor in bf16 through ``_e4m3_as_bf16`` (what the grouped GEMMs' tiles go through; for
    checking it against torch's conversion)."""
    flat = weights.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=weights.device)
    block = 1024
    _e4m3_as_bf16_kernel[(triton.cdiv(flat.numel(), block),)](flat, out, flat.numel(), BLOCK=block)
    return out.view(weights.shape)


@triton.jit
def _weight_product(a, w, acc, scale_rows, k0, col_mask, PRECISION: tl.constexpr, FP8: tl.constexpr,
                    BLOCK_COLS: tl.constexpr, SCALE_AFTER_DOT: tl.constexpr, BF16_ASM: tl.constexpr):
    """acc + a @ w for a [BLOCK_K, BLOCK_N] weight tile. FP8 (``scale_rows``: [BLOCK_N] pointers to each column's
    row of block scales; the tile lies in one block of K, so each column has one scale): ``SCALE_AFTER_DOT`` takes
    the product with the exact FP8 values and multiplies its [BLOCK_M, BLOCK_N] partial sums by the columns' scales
    before they join the accumulator (a multiply per output rather than per weight; bf16 on the GPU converts with
    ``_e4m3_as_bf16`` when ``BF16_ASM``); else each weight times its scale, rounded to the activations' dtype, as the
    torch path dequantizes."""
    # one return after the branches: the compiler also visits code after a return inside a constexpr branch,
    # and two returns of different types do not compile (the interpreter runs them fine)
    if FP8:
        scale = tl.load(scale_rows + k0 // BLOCK_COLS, mask=col_mask, other=0.0)
        if SCALE_AFTER_DOT:
            if BF16_ASM:
                exact = _e4m3_as_bf16(w)
            else:
                exact = w.to(a.dtype)
            out = acc + tl.dot(a, exact, input_precision=PRECISION) * scale[None, :]
        else:
            out = tl.dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc, input_precision=PRECISION)
    else:
        out = tl.dot(a, w, acc, input_precision=PRECISION)
    return out


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, inter, hidden,
                         stride_xt, stride_we, stride_wn, stride_wk, stride_ot, w_scale_ptr, stride_wse, stride_wsn,
                         gate_blocks, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr = False,
                         BLOCK_ROWS: tl.constexpr = 1, BLOCK_COLS: tl.constexpr = 1,
                         SCALE_AFTER_DOT: tl.constexpr = False, BF16_ASM: tl.constexpr = False,
                         EVEN_K: tl.constexpr = False):
    wait_for_previous(PDL)
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, valid, cols, col_mask = _block_tile(sorted_pairs_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pairs // TOP_K)[:, None] * stride_xt + ks[None, :]
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter * stride_wn
    # FP8: the gate rows' block scales, then the up rows' (gate_blocks rows further)
    gate_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + (cols // BLOCK_ROWS) * stride_wsn
    up_scales = gate_scales + gate_blocks * stride_wsn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (ks < hidden - k0) | EVEN_K  # a K that BLOCK_K divides: no K mask in the loop
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc_gate = _weight_product(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, gate_scales, k0, col_mask,
                                   PRECISION, FP8, BLOCK_COLS, SCALE_AFTER_DOT, BF16_ASM)
        acc_up = _weight_product(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, up_scales, k0, col_mask,
                                 PRECISION, FP8, BLOCK_COLS, SCALE_AFTER_DOT, BF16_ASM)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    activated = silu_times(acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], activated, mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _down_weighted_kernel(h_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, pair_weights_ptr, num_pairs,
                          hidden, inter, stride_ht, stride_we, stride_wn, stride_wk, stride_ot, w_scale_ptr,
                          stride_wse, stride_wsn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr = False,
                          BLOCK_ROWS: tl.constexpr = 1, BLOCK_COLS: tl.constexpr = 1,
                          SCALE_AFTER_DOT: tl.constexpr = False, BF16_ASM: tl.constexpr = False,
                          EVEN_K: tl.constexpr = False):
    wait_for_previous(PDL)
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, valid, cols, col_mask = _block_tile(sorted_pairs_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None] * stride_ht + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + (cols // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = (ks < inter - k0) | EVEN_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        acc = _weight_product(a, tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0), acc, scales,
                              k0, col_mask, PRECISION, FP8, BLOCK_COLS, SCALE_AFTER_DOT, BF16_ASM)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    router_weight = tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * router_weight[:, None]).to(dtype)
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], out, mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _pair_gemv(x_row, w_rows, col_mask, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               scale_rows, FP8: tl.constexpr, BLOCK_COLS: tl.constexpr, SPAN: tl.constexpr):
    """fp32 dot products of one activation row with BLOCK_N weight rows over the whole K (K a compile-time
    constant: the loop unrolls, every weight load issues at once). FP8: ``_fp8_pair_products``."""
    if FP8:
        acc = tl.sum(_fp8_pair_products(x_row, w_rows, col_mask, K, BLOCK_N, BLOCK_K, scale_rows, BLOCK_COLS, SPAN),
                     axis=1)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            a = tl.load(x_row + kk, mask=k_mask, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def _fp8_pair_products(x_row, w_rows, col_mask, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       scale_rows, BLOCK_COLS: tl.constexpr, SPAN: tl.constexpr):
    """``_pair_gemv`` of FP8 weights (``scale_rows``: [BLOCK_N] pointers to each row's block scales): each chunk a
    [BLOCK_N, BLOCK_K] tile of BLOCK_K / SPAN groups (SPAN divides the block's width: one scale per row and group,
    ``fp8_linear.group_scales``), each weight times its scale rounded to the activations' dtype, the products summed
    elementwise ([BLOCK_N, BLOCK_K], for the caller to reduce across the threads once); x read in the chunk's own
    shape. As
    ``fp8_linear``'s GEMV: the sm_90 compile of a per-element scale gather and a per-chunk reduction issued a 4-byte
    scale load per weight and exchanged registers through shared memory."""
    row_mask = col_mask[:, None]
    chunk_shape = tl.zeros([BLOCK_N, 1], dtype=tl.int32)  # x broadcast over the rows: loaded in their layout
    dtype = x_row.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_mask = kk < K
        w = tl.load(w_rows + kk, mask=row_mask & k_mask, other=0.0)
        scale = group_scales(scale_rows, col_mask, k0, K, BLOCK_N, BLOCK_COLS, BLOCK_K // SPAN, SPAN)
        w = (w.to(tl.float32) * scale).to(dtype).to(tl.float32)
        acc += w * tl.load(x_row + kk + chunk_shape, mask=k_mask & (chunk_shape == 0), other=0.0).to(tl.float32)
    return acc


@triton.jit
def _pair_tile(ids_ptr, w_ptr, n_cols, stride_we, stride_wn, BLOCK_N: tl.constexpr):
    """This program's (token, slot) pair, its output columns and their rows of the pair's expert weight."""
    pair = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    return pair, cols, cols < n_cols, w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn


@triton.jit
def _pair_scale_rows(ids_ptr, w_scale_ptr, stride_wse, stride_wsn, cols, BLOCK_ROWS: tl.constexpr):
    """FP8: [BLOCK_N] pointers to the block-scale rows of this pair's expert's output rows ``cols``."""
    expert = tl.load(ids_ptr + tl.program_id(1)).to(tl.int64)
    return w_scale_ptr + expert * stride_wse + (cols // BLOCK_ROWS) * stride_wsn


@triton.jit
def _gate_up_silu_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, inter, stride_xt, stride_we, stride_wn, stride_ot,
                              w_scale_ptr, stride_wse, stride_wsn, gate_blocks,
                              K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PDL: tl.constexpr, FP8: tl.constexpr = False, BLOCK_ROWS: tl.constexpr = 1,
                              BLOCK_COLS: tl.constexpr = 1, SPAN: tl.constexpr = 1):
    wait_for_previous(PDL)
    pair, cols, col_mask, gate_rows = _pair_tile(ids_ptr, w_ptr, inter, stride_we, stride_wn, BLOCK_N)
    x_row = x_ptr + (pair // TOP_K) * stride_xt
    gate_scales = _pair_scale_rows(ids_ptr, w_scale_ptr, stride_wse, stride_wsn, cols, BLOCK_ROWS)
    if FP8:  # both halves' products before either sum: the up loads issue before the gate's exchange across warps
        gate = _fp8_pair_products(x_row, gate_rows, col_mask, K, BLOCK_N, BLOCK_K, gate_scales, BLOCK_COLS, SPAN)
        up = _fp8_pair_products(x_row, gate_rows + inter * stride_wn, col_mask, K, BLOCK_N, BLOCK_K,
                                gate_scales + gate_blocks * stride_wsn, BLOCK_COLS, SPAN)
        acc_gate, acc_up = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    else:
        acc_gate = _pair_gemv(x_row, gate_rows, col_mask, K, BLOCK_N, BLOCK_K, gate_scales, FP8, BLOCK_COLS, SPAN)
        acc_up = _pair_gemv(x_row, gate_rows + inter * stride_wn, col_mask, K, BLOCK_N, BLOCK_K,
                            gate_scales + gate_blocks * stride_wsn, FP8, BLOCK_COLS, SPAN)
    dtype = out_ptr.dtype.element_ty
    activated = silu_times(acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    tl.store(out_ptr + pair * stride_ot + cols, activated, mask=col_mask)


@triton.jit
def _down_weighted_gemv_kernel(h_ptr, w_ptr, ids_ptr, pair_weights_ptr, out_ptr, hidden, stride_ht, stride_we,
                               stride_wn, stride_ot, w_scale_ptr, stride_wse, stride_wsn, K: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                               FP8: tl.constexpr = False, BLOCK_ROWS: tl.constexpr = 1, BLOCK_COLS: tl.constexpr = 1,
                               SPAN: tl.constexpr = 1):
    wait_for_previous(PDL)
    pair, cols, col_mask, rows = _pair_tile(ids_ptr, w_ptr, hidden, stride_we, stride_wn, BLOCK_N)
    scales = _pair_scale_rows(ids_ptr, w_scale_ptr, stride_wse, stride_wsn, cols, BLOCK_ROWS)
    acc = _pair_gemv(h_ptr + pair * stride_ht, rows, col_mask, K, BLOCK_N, BLOCK_K, scales, FP8, BLOCK_COLS, SPAN)
    dtype = out_ptr.dtype.element_ty
    router_weight = tl.load(pair_weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * stride_ot + cols, (acc.to(dtype).to(tl.float32) * router_weight).to(dtype),
             mask=col_mask)


@triton.jit
def _sum_top_k_kernel(per_pair_ptr, out_ptr, shared_ptr, shared_gate_ptr, hidden, stride_shared, stride_gate,
                      TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        total += tl.load(per_pair_ptr + (token * TOP_K + slot) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = total.to(dtype)
    if SHARED:
        # moe + sigmoid(gate) * shared, each step rounded as SparseMoE's torch combine rounds it (the sigmoid, the
        # product, the sum); the sigmoid itself is 1 / (1 + exp(-g)) in fp32, which may differ from torch's in
        # the last fp32 ulp before that rounding
        gate = tl.load(shared_gate_ptr + token * stride_gate).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + token * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + (gate * shared).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * hidden + cols, out, mask=mask)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                  expert_weights: torch.Tensor, config: dict | None = None, *, shared: torch.Tensor | None = None,
                  shared_gate: torch.Tensor | None = None, gemv: bool = False,
                  fp8_scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None) -> torch.Tensor:
    """Same contract as ``models.layers.moe.run_experts`` with SiLU: x [T, H]; gate_up [E, 2I, H];
    down [E, H, I]; expert_ids/weights [T, k] -> [T, H]: ``expert_pairs`` then ``sum_top_k``.

    With ``shared`` [T, H] (a shared expert's output) and ``shared_gate`` [T, 1] (its gate logit; any row
    strides) the top-k sum's launch also adds ``sigmoid(shared_gate) * shared``: the talker's combine.
    ``gemv``: up to ``GEMV_MAX_TOKENS`` tokens, each (token, slot) pair runs as multiply-add GEMVs over its own
    expert's weights (no expert-sorted layout: one launch fewer), as ``kernels.small_linear``'s GEMV does for
    the dense linears. ``fp8_scales``: FP8 experts' block scales (``expert_pairs``)."""
    check_shared(x, shared, shared_gate)
    per_pair = expert_pairs(x, gate_up, down, expert_ids, expert_weights, config, gemv=gemv, fp8_scales=fp8_scales)
    return sum_top_k(per_pair, expert_ids.shape[1], shared, shared_gate)


def check_shared(x: torch.Tensor, shared: torch.Tensor | None, shared_gate: torch.Tensor | None) -> None:
    """The shared expert's output and gate logit fit x (checked before any launch)."""
    if (shared is None) != (shared_gate is None):
        raise ValueError("fused_experts takes shared and shared_gate together")
    if shared is not None and (shared.shape != x.shape or shared.stride(-1) != 1
                               or shared_gate.shape != (x.shape[0], 1)):
        raise ValueError(f"fused_experts shared {tuple(shared.shape)} / shared_gate {tuple(shared_gate.shape)} "
                         f"do not match x {tuple(x.shape)} (want [T, H] with contiguous features and [T, 1])")


def expert_pairs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                 expert_weights: torch.Tensor, config: dict | None = None, *, gemv: bool = False,
                 fp8_scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None) -> torch.Tensor:
    """per_pair [T * k, H]: each (token, slot) pair's expert output times its router weight (``fused_experts``
    without the top-k sum, so that other work can be joined in before it). ``fp8_scales``: (gate_up scales
    [E, 2 * ceil(I / b0), ceil(H / b1)], down scales [E, ceil(H / b0), ceil(I / b1)], block (b0, b1)) of
    float8_e4m3fn ``gate_up`` and ``down`` (``layers.fp8.Fp8Experts``)."""
    if x.stride(-1) != 1 or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("fused_experts needs the last dim of x and of the expert weights contiguous")
    if (fp8_scales is not None) != (gate_up.dtype == torch.float8_e4m3fn):
        raise ValueError(f"fused_experts: {gate_up.dtype} expert weights "
                         f"{'without' if fp8_scales is None else 'with'} FP8 block scales")
    pdl = enabled_for(x)
    quant = _fp8_launch(fp8_scales)
    if gemv and x.shape[0] <= GEMV_MAX_TOKENS:
        return _experts_by_pair(x, gate_up, down, expert_ids, expert_weights, pdl, quant)
    return _experts_by_block(x, gate_up, down, expert_ids, expert_weights, config, pdl, quant)


def _fp8_launch(fp8_scales) -> dict:
    """The kernels' FP8 arguments: (gate_up scales, down scales) and the constexprs, or plain weights'."""
    if fp8_scales is None:
        return dict(scales=(None, None), consts=dict(FP8=False, BLOCK_ROWS=1, BLOCK_COLS=1), block_k=None)
    gate_up_scales, down_scales, block = fp8_scales
    return dict(scales=(gate_up_scales, down_scales), block_k=k_tile(block[1]),
                consts=dict(FP8=True, BLOCK_ROWS=block[0], BLOCK_COLS=block[1]))


def _scale_args(scales: torch.Tensor | None, like: torch.Tensor) -> tuple:
    """(pointer, expert stride, row stride) of a block-scale tensor (``like`` and zeros without one)."""
    return (like, 0, 0) if scales is None else (scales, scales.stride(0), scales.stride(1))


def sum_top_k(per_pair: torch.Tensor, top_k: int, shared: torch.Tensor | None = None,
              shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """per_pair [T * k, H] -> [T, H]: each token's k pair outputs summed (fp32, rounded once), plus
    ``sigmoid(shared_gate) * shared`` when given (``fused_experts``' combine)."""
    num_pairs, hidden = per_pair.shape
    num_tokens = num_pairs // top_k
    out = torch.empty(num_tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    pdl = enabled_for(per_pair)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block))](
        per_pair, out, out if shared is None else shared, out if shared_gate is None else shared_gate, hidden,
        0 if shared is None else shared.stride(0), 0 if shared_gate is None else shared_gate.stride(0),
        TOP_K=top_k, SHARED=shared is not None, BLOCK=block, num_warps=4, PDL=pdl, launch_pdl=pdl)
    return out


# Up to here ``gemv=True`` runs the per-pair GEMVs (a decode step's 1-2 rows, as small_linear.GEMV_MAX_ROWS)
GEMV_MAX_TOKENS = 2
GEMV_MIN_PROGRAMS = 512  # ~4 per SM of a 132-SM GPU, as small_linear.GEMV_MIN_PROGRAMS


# (kernel, K, N) -> (BLOCK_N, BLOCK_K, num_warps) where another launch shape than ``pair_gemv_blocks``' rule with
# 4 warps measured faster (benchmarks/gemv_sweep.py, the thinker's 8 pairs of one token; docs/performance.md)
PAIR_GEMV_TUNED = {("gate_up", 2048, 768): (2, 2048, 8), ("down", 768, 2048): (16, 256, 8)}


def pair_gemv_launch(kernel: str, num_pairs: int, cols: int, depth: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a per-pair GEMV ("gate_up" or "down"): the tuned entry, else the rule."""
    return PAIR_GEMV_TUNED.get((kernel, depth, cols), (*pair_gemv_blocks(num_pairs, cols, depth), 4))


def pair_gemv_blocks(num_pairs: int, cols: int, depth: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the per-pair GEMVs: 2-8 output columns a program, so that the launch has about
    ``GEMV_MIN_PROGRAMS`` programs over all pairs, each holding ~4K weights of a K chunk."""
    block_n = max(2, min(8, 1 << max(0, (cols * num_pairs // GEMV_MIN_PROGRAMS).bit_length() - 1)))
    return block_n, min(triton.next_power_of_2(depth), max(16, 4096 // block_n))


def _experts_by_pair(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                     expert_weights: torch.Tensor, pdl: bool, quant: dict) -> torch.Tensor:
    """per_pair [T * k, H]: each pair's expert output times its router weight, by per-pair GEMVs."""
    num_tokens, hidden = x.shape
    inter = gate_up.shape[1] // 2
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    ids = expert_ids.reshape(-1)
    activated = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = pair_gemv_launch("gate_up", num_pairs, inter, hidden)
    gate_up_scales, down_scales = quant["scales"]
    _gate_up_silu_gemv_kernel[(triton.cdiv(inter, block_n), num_pairs)](
        x, gate_up, ids, activated, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), activated.stride(0),
        *_scale_args(gate_up_scales, x), 0 if gate_up_scales is None else gate_up_scales.shape[1] // 2,
        K=hidden, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, SPAN=_span(quant, block_k), num_warps=warps,
        PDL=pdl, launch_pdl=pdl, **quant["consts"])
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = pair_gemv_launch("down", num_pairs, hidden, inter)
    _down_weighted_gemv_kernel[(triton.cdiv(hidden, block_n), num_pairs)](
        activated, down, ids, expert_weights.reshape(-1), per_pair, hidden, activated.stride(0), down.stride(0),
        down.stride(1), per_pair.stride(0), *_scale_args(down_scales, x), K=inter, BLOCK_N=block_n, BLOCK_K=block_k,
        SPAN=_span(quant, block_k), num_warps=warps, PDL=pdl, launch_pdl=pdl, **quant["consts"])
    return per_pair


def _span(quant: dict, block_k: int) -> int:
    """FP8 per-pair GEMVs: the width of a chunk's groups (inside one block of scales; divides the power-of-two
    ``block_k``); plain weights: unused."""
    return 1 if quant["block_k"] is None else min(quant["block_k"], block_k)


def _experts_by_block(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                      expert_weights: torch.Tensor, config: dict | None, pdl: bool, quant: dict) -> torch.Tensor:
    """per_pair [T * k, H] by the two grouped GEMMs over the expert-sorted layout."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    fp8 = quant["block_k"] is not None
    config = config or block_config(num_tokens, num_experts, hidden, inter, fp8=fp8)
    block_m = config["BLOCK_M"]
    sorted_pairs, block_expert = expert_sorted_layout(expert_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models (tests) keep fp32 products

    gate_up_scales, down_scales = quant["scales"]

    def depth_tile(cfg: dict) -> int:  # FP8: a K tile inside one scale block
        return cfg["BLOCK_K"] if quant["block_k"] is None else min(cfg["BLOCK_K"], quant["block_k"])

    def fp8_order(cfg: dict) -> dict:  # FP8: where the scales apply (tuned per GEMM, else by the tile's rows)
        if not fp8:
            return {}
        return dict(SCALE_AFTER_DOT=cfg.get("SCALE_AFTER_DOT", block_m <= SCALE_AFTER_DOT_MAX_ROWS),
                    BF16_ASM=x.dtype == torch.bfloat16 and x.is_cuda and not INTERPRETED)

    activated = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    gate_cfg = config["gate_up"]
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, gate_cfg["BLOCK_N"]))](
        x, gate_up, activated, sorted_pairs, block_expert, num_pairs, inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), activated.stride(0),
        *_scale_args(gate_up_scales, x), 0 if gate_up_scales is None else gate_up_scales.shape[1] // 2,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=gate_cfg["BLOCK_N"], BLOCK_K=depth_tile(gate_cfg), PRECISION=precision,
        EVEN_K=hidden % depth_tile(gate_cfg) == 0,
        num_warps=gate_cfg["num_warps"], num_stages=gate_cfg["num_stages"], PDL=pdl, launch_pdl=pdl,
        **quant["consts"], **fp8_order(gate_cfg))

    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down_cfg = config["down"]
    _down_weighted_kernel[(num_blocks, triton.cdiv(hidden, down_cfg["BLOCK_N"]))](
        activated, down, per_pair, sorted_pairs, block_expert, expert_weights.reshape(-1), num_pairs, hidden, inter,
        activated.stride(0), down.stride(0), down.stride(1), down.stride(2), per_pair.stride(0),
        *_scale_args(down_scales, x), BLOCK_M=block_m, BLOCK_N=down_cfg["BLOCK_N"], BLOCK_K=depth_tile(down_cfg),
        EVEN_K=inter % depth_tile(down_cfg) == 0,
        PRECISION=precision, num_warps=down_cfg["num_warps"], num_stages=down_cfg["num_stages"], PDL=pdl,
        launch_pdl=pdl, **quant["consts"], **fp8_order(down_cfg))
    return per_pair


# FP8 tiles without a tuned entry scale the partial sums (``SCALE_AFTER_DOT``) up to this many rows: mma.sync
# tiles at a decode step's few pairs per expert, where the instructions per weight byte bound the kernel. Tiles of
# 64 rows and more compile to wgmma on sm_90, whose dot would have to finish each K tile before its scale (no
# overlap of the tensor cores with the next tile's conversion, at prefill sizes where the tensor cores count):
# those keep the scales on the weights unless the tuner picked otherwise.
SCALE_AFTER_DOT_MAX_ROWS = 32


def shape_key(num_experts: int, hidden: int, inter: int, fp8: bool = False) -> str:
    """The tuned table's key of an expert shape; FP8 experts (block-FP8 weights, w8a16) have entries of their own:
    their kernels convert every weight, so bf16's tiles need not suit them."""
    return f"E{num_experts}_H{hidden}_I{inter}" + ("_fp8" if fp8 else "")


def default_config(num_tokens: int) -> dict:
    """Size rule when no tuned entry exists: small M blocks at decode (few pairs per expert), larger ones
    once every expert gets tens of tokens."""
    if num_tokens <= 64:
        gemm = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
        return dict(BLOCK_M=16, gate_up=gemm, down=dict(gemm))
    gemm = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64 if num_tokens > 256 else 32, gate_up=gemm, down=dict(gemm))


@functools.lru_cache(maxsize=None)
def _tuned_table(device_name: str, key: str) -> dict[int, dict]:
    if not CONFIG_FILE.is_file():
        return {}
    by_shape = json.loads(CONFIG_FILE.read_text()).get(device_name, {})
    return {int(bucket): cfg for bucket, cfg in by_shape.get(key, {}).items()}


def block_config(num_tokens: int, num_experts: int, hidden: int, inter: int, fp8: bool = False) -> dict:
    """The tuned entry of the smallest bucket >= num_tokens, or the size rule past the tuned buckets (``fp8``: FP8
    experts' own entries, never bf16's)."""
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    table = _tuned_table(device_name, shape_key(num_experts, hidden, inter, fp8))
    fitting = [bucket for bucket in table if bucket >= num_tokens]
    return table[min(fitting)] if fitting else default_config(num_tokens)
