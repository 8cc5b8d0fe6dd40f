"""silu(gate) * up in one launch, over the output of a packed gate/up projection ``[T, 2I]``.

Rounds like the torch path (``F.silu(gate) * up`` in the activation dtype: the activation, then the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, squares_ptr, inter, stride_x, stride_out, num_rows, square_blocks,
                         norm_size, eps, BLOCK: tl.constexpr, INPUT_NORM: tl.constexpr, SQUARE_BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if INPUT_NORM:  # the projection's pre-norm, folded into its weight: this row's rstd, then the rounded outputs
        blocks = tl.arange(0, SQUARE_BLOCK)
        squares = tl.load(squares_ptr + blocks * num_rows + row, mask=blocks < square_blocks, other=0.0)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / norm_size + eps)
        gate = (gate * rstd).to(dtype).to(tl.float32)
        up = (up * rstd).to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, input_norm: tuple[torch.Tensor, int, float] | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> [T, I].

    ``input_norm`` = (squares [blocks, T] float32, size, eps): gate_up is ``x @ (W * norm_weight).T``, the
    projection of x with its RMSNorm's weight folded in; each row is first scaled by
    ``rsqrt(sum(squares[:, row]) / size + eps)`` and rounded, as the projection of the normed row would be
    (``squares``: the partial sums of x's squares that ``small_linear(row_squares=True)`` hands on)."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_and_mul needs the feature dim contiguous")
    squares, norm_size, eps = input_norm if input_norm is not None else (gate_up, 1, 0.0)
    if input_norm is not None and (squares.dtype != torch.float32 or squares.dim() != 2
                                   or squares.shape[1] != num_tokens or not squares.is_contiguous()):
        raise ValueError(f"silu_and_mul input_norm squares must be contiguous float32 [blocks, {num_tokens}], "
                         f"got {squares.dtype} {tuple(squares.shape)}")
    square_blocks = squares.shape[0] if input_norm is not None else 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        pdl = enabled_for(gate_up)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, squares, inter, gate_up.stride(0), out.stride(0), num_tokens, square_blocks,
            float(norm_size), float(eps), BLOCK=block, INPUT_NORM=input_norm is not None,
            SQUARE_BLOCK=max(2, triton.next_power_of_2(square_blocks)), num_warps=4, PDL=pdl, launch_pdl=pdl)
    return out
