"""silu(gate) * up in one launch, over the output of a packed gate/up projection ``[T, 2I]``.

Rounds like the torch path (``F.silu(gate) * up`` in the activation dtype: the activation, then the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up rounded as the torch path rounds (gate and up fp32 holding ``dtype`` values): the
    activation to ``dtype``, then the product to ``dtype``. The epilogue of every gated kernel."""
    return ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def rstd_from_squares(squares_ptr, rows, num_rows, square_blocks, norm_size, eps, SQUARE_BLOCK: tl.constexpr):
    """Each of ``rows``' ``rsqrt(sum(squares[:, row]) / norm_size + eps)`` [R], from the column blocks' partial
    sums of squares ``squares [square_blocks, num_rows]`` (``small_linear(row_squares=True)``): the row scale of
    an RMSNorm folded into the next projection's weight."""
    blocks = tl.arange(0, SQUARE_BLOCK)
    squares = tl.load(squares_ptr + blocks[:, None] * num_rows + rows[None, :],
                      mask=(blocks < square_blocks)[:, None] & (rows < num_rows)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(squares, axis=0) / norm_size + eps)


def checked_input_norm(input_norm: tuple[torch.Tensor, int, float] | None, num_tokens: int, fallback: torch.Tensor,
                       caller: str) -> tuple[torch.Tensor, float, float, int]:
    """(squares, size, eps, square blocks) of an ``input_norm`` argument, checked; without one, placeholders
    (``fallback`` for the unread pointer)."""
    if input_norm is None:
        return fallback, 1.0, 0.0, 1
    squares, norm_size, eps = input_norm
    if (squares.dtype != torch.float32 or squares.dim() != 2 or squares.shape[1] != num_tokens
            or not squares.is_contiguous()):
        raise ValueError(f"{caller} input_norm squares must be contiguous float32 [blocks, {num_tokens}], "
                         f"got {squares.dtype} {tuple(squares.shape)}")
    return squares, float(norm_size), float(eps), squares.shape[0]


def square_block(square_blocks: int) -> int:
    """``SQUARE_BLOCK``: the column blocks of squares, padded to a power of two (at least 2)."""
    return max(2, triton.next_power_of_2(square_blocks))


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
        rstd = rstd_from_squares(squares_ptr, row + tl.arange(0, 1), num_rows, square_blocks, norm_size, eps,
                                 SQUARE_BLOCK)
        gate = (gate * rstd).to(dtype).to(tl.float32)
        up = (up * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up, dtype), mask=mask)


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
    squares, norm_size, eps, square_blocks = checked_input_norm(input_norm, num_tokens, gate_up, "silu_and_mul")
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        pdl = enabled_for(gate_up)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, squares, inter, gate_up.stride(0), out.stride(0), num_tokens, square_blocks, norm_size,
            eps, BLOCK=block, INPUT_NORM=input_norm is not None, SQUARE_BLOCK=square_block(square_blocks),
            num_warps=4, PDL=pdl, launch_pdl=pdl)
    return out
