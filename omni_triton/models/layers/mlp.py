"""Dense feed-forward blocks (names match the checkpoint)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.layers.fast_kernels import KernelSwitch, pack_linears_
from omni_triton.models.layers.fp8_packed import PackedFp8Linear, is_fp8_linear, pack_fp8_linears_

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act={name!r} is not supported; use one of {sorted(ACTIVATIONS)}") from None


class GatedMLP(KernelSwitch, nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP of the code predictor and the talker's shared expert.

    On CUDA with SiLU: one packed gate/up GEMM and one ``silu_and_mul`` launch (``kernels.activation``); FP8
    gate/up pack where their block scales stack (``layers.fp8_packed``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = activation(act)
        self.packed_gate_up: tuple[torch.Tensor, torch.Tensor | None] | PackedFp8Linear | None = None

    def pack_projections_(self) -> None:
        if self.packed_gate_up is None:
            parts = [self.gate_proj, self.up_proj]
            # FP8: packed where the block scales stack, else (None) two launches
            self.packed_gate_up = pack_fp8_linears_(parts) if is_fp8_linear(self.gate_proj) else pack_linears_(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels_for(x) and self.packed_gate_up is not None and self.act is F.silu:
            from omni_triton.kernels.activation import silu_and_mul

            gate_up = (self.packed_gate_up(x) if isinstance(self.packed_gate_up, PackedFp8Linear)
                       else F.linear(x, *self.packed_gate_up))
            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class ResizeMLP(nn.Module):
    """fc2(act(fc1(x))) with biases: the talker's text/hidden projections from thinker width to talker width."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int, act: str = "silu"):
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))
