"""A dilated convolution computed as an undilated one over its input's interleaved phases.

With dilation d, output t reads inputs t, t + d, ..., t + (k - 1) d: all of one phase, t mod d. So the input
[B, C, L] split into its d phases, [B * d, C, ceil(L / d)], convolved with the same weights and no dilation, and
interleaved back gives the same outputs: each the same k-term sum of the same products (equal up to the
kernels' order of summation). Why: cuDNN's heuristic
(``torch.backends.cudnn.benchmark`` off) takes a generic non-tensor-core kernel for the bf16 dilated convolutions of
code2wav's widest decoder blocks, 2 ms each at batch 8 on an H200 (a third of a call), while undilated shapes of
the same width get a tensor-core kernel; cuDNN's timed picks fix it too, at ~100 s of every stage start
(benchmarks/results/h200-code2wav-cudnn). The cost here: the phases' reshuffle in and out, two copies of the
tensor each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def dilated_conv_as_phases(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a stride-1, unpadded ``conv`` (any dilation) on ``x`` [B, C, L]: [B, C_out, L - (k-1) d]."""
    if conv.stride != (1,) or conv.padding != (0,):
        raise ValueError(f"dilated_conv_as_phases takes stride-1 unpadded convs, got stride {conv.stride} "
                         f"padding {conv.padding}")
    dilation, kernel = conv.dilation[0], conv.kernel_size[0]
    batch, channels, length = x.shape
    out_length = length - (kernel - 1) * dilation
    if out_length < 1:
        raise ValueError(f"input of {length} steps is shorter than the conv's reach {(kernel - 1) * dilation + 1}")
    if dilation == 1:
        return conv(x)
    steps = -(-length // dilation)  # per phase; the right padding only makes outputs past out_length, cut below
    x = F.pad(x, (0, steps * dilation - length))
    phases = x.view(batch, channels, steps, dilation).permute(0, 3, 1, 2).reshape(batch * dilation, channels, steps)
    y = F.conv1d(phases, conv.weight, conv.bias, groups=conv.groups)  # [B * d, C_out, steps - k + 1]
    out_steps = y.shape[-1]
    y = y.view(batch, dilation, -1, out_steps).permute(0, 2, 3, 1).reshape(batch, -1, out_steps * dilation)
    return y[..., :out_length]
