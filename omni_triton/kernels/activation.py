"""silu(gate) * up in one launch, over the output of a packed gate/up projection ``[T, 2I]``.

Rounds like the torch path (``F.silu(gate) * up`` in the activation dtype: the activation, then the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> [T, I]."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_and_mul needs the feature dim contiguous")
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        pdl = enabled_for(gate_up)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0),
                                                                      out.stride(0), BLOCK=block, num_warps=4, PDL=pdl,
                                                                      launch_pdl=pdl)
    return out
