"""The switch between a layer's torch code (the CPU path and the reference) and its Triton kernel.

A layer that has a kernel twin (``omni_triton.kernels``) inherits ``KernelSwitch`` and runs the kernel only
for CUDA tensors and only while ``use_kernels`` is on (the default). ``set_fast_kernels(model, False)`` gives
the plain torch path on the GPU too: the eager baseline the fast path is checked and timed against.

A second switch, ``use_fused_steps`` (``set_fused_steps``), covers the whole-step fusions on top of the
per-layer kernels (the code predictor's fused frame, the one-launch prefill attention): off, the fast path is the per-layer kernels alone, which
is what ``benchmarks/engine_microbench.py`` times as the "landed" variant beside the fused one.

A third, ``use_split_k`` (``set_split_k``), gives the fused frame's ``kernels.small_linear`` calls the split-K
launch (several hundred programs instead of 64-128); off (the default until the H200 measures it), they run
the one-pass kernel. The microbenchmark times it as the "splitk" variant beside "graphs".

Switching on also packs the projections that read one input (q/k/v, gate/up) into one weight tensor each,
whose rows the original parameters become views of: one GEMM launch instead of two or three, no extra memory,
state dicts unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class KernelSwitch:
    use_kernels: bool = True
    use_fused_steps: bool = True  # only read by modules that have a whole-step fusion
    use_split_k: bool = False  # only read by the code predictor's fused frame

    def kernels_for(self, x: torch.Tensor) -> bool:
        return self.use_kernels and x.is_cuda

    def pack_projections_(self) -> None:
        """Layers with several projections of one input pack them here (see the module docstring)."""


def pack_linears_(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of out_features, in] weight (and bias) holding ``linears``' rows in order; each linear's
    parameters become views of it."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    row = 0
    for linear in linears:
        rows = slice(row, row + linear.out_features)
        linear.weight.data = weight[rows]
        if bias is not None:
            linear.bias.data = bias[rows]
        row = rows.stop
    return weight, bias


def set_fast_kernels(model: nn.Module, enabled: bool) -> None:
    for module in model.modules():
        if isinstance(module, KernelSwitch):
            module.use_kernels = enabled
            if enabled and any(p.is_cuda for p in module.parameters()):
                module.pack_projections_()


def set_fused_steps(model: nn.Module, enabled: bool) -> None:
    """Whole-step fusions on or off (they run only where ``use_kernels`` is on as well)."""
    for module in model.modules():
        if isinstance(module, KernelSwitch):
            module.use_fused_steps = enabled


def set_split_k(model: nn.Module, enabled: bool) -> None:
    """The split-K launch of the fused frame's linears on or off (``kernels.small_linear``'s ``split_k``)."""
    for module in model.modules():
        if isinstance(module, KernelSwitch):
            module.use_split_k = enabled


def fused_steps_on(model: nn.Module) -> bool:
    """Whether ``model``'s whole-step fusions are on (for the parts an engine builds outside the modules)."""
    return all(module.use_fused_steps for module in model.modules() if isinstance(module, KernelSwitch))
