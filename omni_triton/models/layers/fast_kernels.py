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
``GEMV_MAX_ROWS`` rows multiply-adds, a few columns per program over the whole K; split-K above). It also
covers the decode step's linears of the decoder layers (``step_linear``: attention qkv and o_proj, the MoE's
router and shared expert): "gemv" runs them as the same multiply-add kernel at up to ``GEMV_MAX_ROWS`` rows
(cuBLAS is slower for these few-row products: docs/performance.md), the other two keep cuBLAS, so the
microbenchmark's variants ("graphs", "splitk", "gemv") compare both side by side.

Switching on also packs the projections that read one input (q/k/v, gate/up; the talker MoE's shared-expert
gate/up, router and shared-expert gate) into one weight tensor each, whose rows the original parameters become
views of: one GEMM launch instead of two to four, no extra memory, state dicts unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KernelSwitch:
    use_kernels: bool = True
    use_fused_steps: bool = True  # read by the whole-step fusions and step_linear (off: cuBLAS there)
    # one of LINEAR_LAUNCHES: the code predictor's fused frame and, under "gemv", the decoder layers' step_linear
    linear_launch: str = "gemv"

    def kernels_for(self, x: torch.Tensor) -> bool:
        return self.use_kernels and x.is_cuda

    def pack_projections_(self) -> None:
        """Layers with several projections of one input pack them here (see the module docstring)."""


def pack_linears_(linears: list[nn.Linear], align_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of out_features, in] weight (and bias) holding ``linears``' rows in order; each linear's
    parameters become views of it. ``align_rows``: zero rows after them up to a multiple of it, so that the
    product's row stride is aligned (cuBLAS takes a slow ``align1`` kernel for an odd-width output)."""
    with torch.no_grad():
        rows = sum(linear.out_features for linear in linears)
        padding = -rows % align_rows
        weight = torch.cat([linear.weight for linear in linears]
                           + [linears[0].weight.new_zeros(padding, linears[0].in_features)])
        bias = (None if linears[0].bias is None else
                torch.cat([linear.bias for linear in linears] + [linears[0].bias.new_zeros(padding)]))
    row = 0
    for linear in linears:
        rows = slice(row, row + linear.out_features)
        linear.weight.data = weight[rows]
        if bias is not None:
            linear.bias.data = bias[rows]
        row = rows.stop
    return weight, bias


def step_linear(module: KernelSwitch, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a decoder layer; at a decode step's few rows (up to ``GEMV_MAX_ROWS``),
    with ``module``'s kernels and fused steps on and ``linear_launch`` "gemv", the multiply-add kernel
    (``small_linear(gemv=True)``: rounded to x's dtype as cuBLAS's output is) in place of cuBLAS's GEMV.
    ``weight`` may be a row slice of a packed weight, x any row stride."""
    if (bias is None and module.kernels_for(x) and module.use_fused_steps and module.linear_launch == "gemv"
            and x.stride(-1) == 1):
        from omni_triton.kernels.small_linear import GEMV_MAX_ROWS, small_linear

        if x.shape[0] <= GEMV_MAX_ROWS:
            return small_linear(x, weight, gemv=True)
    return F.linear(x, weight, bias)


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
