"""Sparse mixture-of-experts block (thinker: routed experts only; talker: + sigmoid-gated shared expert).

Expert weights are stored stacked per layer: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up)
and ``experts.down_proj [E, H, I]``; the loader fills them from the checkpoint's per-expert tensors.
On CUDA tensors (``use_kernels`` on, SiLU experts) the router and the experts run as Triton kernels
(``kernels.routing``, ``kernels.fused_moe``); ``route`` and ``run_experts`` here are the CPU path and the
reference they are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.layers.fast_kernels import KernelSwitch
from omni_triton.models.layers.mlp import GatedMLP, activation


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over all experts, keep top-k, renormalise them if asked.

    Returns (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor, act=F.silu) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; expert_ids/weights [T, k] -> [T, H].

    Token-sorted reference: (token, slot) pairs are sorted by expert, each hit expert runs one matmul over
    its contiguous run of tokens, results are scattered back weighted by the router."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    weights = expert_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of_pair[start:start + count]
        gate, up = F.linear(x.index_select(0, rows), gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[expert]) * weights[start:start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoE(KernelSwitch, nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int = 0, act: str = "silu"):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = activation(act)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size)
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        if self.kernels_for(x) and self.act is F.silu:
            from omni_triton.kernels import fused_moe, routing

            weights, ids = routing.route(router_logits, self.top_k, self.norm_topk_prob)
            out = fused_moe.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights)
        else:
            weights, ids = route(router_logits, self.top_k, self.norm_topk_prob)
            out = run_experts(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
