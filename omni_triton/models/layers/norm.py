"""RMSNorm computed in fp32 and cast back before the weight (transformers' Qwen3 order, so bf16 matches).

On CUDA tensors one Triton launch (``kernels.norm``) does the same roundings; ``add_forward`` also folds in
the residual add of a pre-norm block.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_triton.models.layers.fast_kernels import KernelSwitch


class RMSNorm(KernelSwitch, nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels_for(x):
            from omni_triton.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        if self.kernels_for(x):
            from omni_triton.kernels.norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self(summed), summed
