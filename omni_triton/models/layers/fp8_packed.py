"""Packed products of FP8 linears that read one input (q/k/v, gate/up), where their block scales stack.

A packed bf16 weight is its parts' rows one after another (``fast_kernels.pack_linears_``). An FP8 weight has one
scale per block of ``block[0]`` rows, so its parts' ``weight_scale_inv`` rows stacked the same way are the packed
weight's scales only where every part but the last ends on a block boundary: a part ending inside a block would
have the next part's first rows read its last block's scale. There (at the released sizes the thinker's, the
talker's and the code predictor's q/k/v and gate/up widths are all multiples of 128) the weights, scales and
biases are packed and one product serves every part; the parts' parameters become views of the packed tensors
(state dicts unchanged, no extra memory). Elsewhere the parts keep their own launches, as before: the tiny model
quantized at load (128 x 128 blocks) packs its code predictor's gate/up (128 wide) but not its 64-wide q or the
talker's 64-wide shared-expert gate.

The packed product runs with the first part's switches (kernels, activations, launch: ``set_fast_kernels`` and
``set_fp8_activations`` reach the registered modules, not the pack), through the same code as the part's own
forward (``Fp8Linear.product``): the FP8 kernels on CUDA, the dequantized weight in torch elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_triton.models.quantization import FP8_DTYPE


class PackedFp8Linear:
    """The FP8 parts' packed weight [sum of out_features, in], scales and bias; called like a linear."""

    def __init__(self, parts: list[nn.Module], weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 bias: torch.Tensor | None):
        self.parts, self.weight, self.weight_scale_inv, self.bias = parts, weight, weight_scale_inv, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts[0].product(x, self.weight, self.weight_scale_inv, self.bias)


def is_fp8_linear(module: nn.Module) -> bool:
    return getattr(module, "weight", None) is not None and module.weight.dtype == FP8_DTYPE


def scales_stack(linears: list[nn.Module]) -> bool:
    """Whether the parts' block scales stacked are the packed weight's: all FP8 of one block and input width (with
    biases or without), every part but the last a whole number of block rows."""
    first = linears[0]
    return (all(is_fp8_linear(linear) for linear in linears)
            and all(linear.block == first.block and linear.in_features == first.in_features
                    and (linear.bias is None) == (first.bias is None) for linear in linears)
            and all(linear.out_features % first.block[0] == 0 for linear in linears[:-1]))


def pack_fp8_linears_(linears: list[nn.Module]) -> PackedFp8Linear | None:
    """The parts packed (their weights, scales and biases become views of the packed tensors), or None where their
    scales do not stack (``scales_stack``): then nothing changes."""
    if not scales_stack(linears):
        return None
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        scale_inv = torch.cat([linear.weight_scale_inv for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    row = block_row = 0
    for linear in linears:
        rows = slice(row, row + linear.out_features)
        blocks = slice(block_row, block_row + linear.weight_scale_inv.shape[0])
        linear.weight.data = weight[rows]
        linear.weight_scale_inv.data = scale_inv[blocks]
        if bias is not None:
            linear.bias.data = bias[rows]
        row, block_row = rows.stop, blocks.stop
    return PackedFp8Linear(list(linears), weight, scale_inv, bias)
