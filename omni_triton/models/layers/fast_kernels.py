"""The switch between a layer's torch code (the CPU path and the reference) and its Triton kernel.

A layer that has a kernel twin (``omni_triton.kernels``) inherits ``KernelSwitch`` and runs the kernel only
for CUDA tensors and only while ``use_kernels`` is on (the default). ``set_fast_kernels(model, False)`` gives
the plain torch path on the GPU too: the eager baseline the fast path is checked and timed against.

A second switch, ``use_fused_steps`` (``set_fused_steps``), covers the whole-step fusions on top of the
per-layer kernels (the code predictor's fused frame, the one-launch prefill attention): off, the fast path is the per-layer kernels alone, which
is what ``benchmarks/engine_microbench.py`` times as the "landed" variant beside the fused one.

A third, ``linear_launch`` (``set_linear_launch``), picks how the fused frame's ``kernels.small_linear`` calls
launch: "one-pass" (64-256 programs, an MMA tile each), "split-k" (K cut into slices too: several hundred
programs, partials summed by the last; up to ``SPLIT_MAX_ROWS`` rows) or "gemv" (the default: up to
``GEMV_MAX_ROWS`` rows multiply-adds, a few columns per program over the whole K; split-K above). The
microbenchmark times them as the "graphs", "splitk" and "gemv" variants.

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
    linear_launch: str = "gemv"  # one of LINEAR_LAUNCHES; only read by the code predictor's fused frame

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


LINEAR_LAUNCHES = ("one-pass", "split-k", "gemv")


def set_linear_launch(model: nn.Module, launch: str) -> None:
    """How the fused frame's linears launch (``kernels.small_linear``'s ``split_k`` and ``gemv``)."""
    if launch not in LINEAR_LAUNCHES:
        raise ValueError(f"linear launch must be one of {', '.join(LINEAR_LAUNCHES)}; got {launch!r}")
    for module in model.modules():
        if isinstance(module, KernelSwitch):
            module.linear_launch = launch


def fused_steps_on(model: nn.Module) -> bool:
    """Whether ``model``'s whole-step fusions are on (for the parts an engine builds outside the modules)."""
    return all(module.use_fused_steps for module in model.modules() if isinstance(module, KernelSwitch))
