"""Sparse mixture-of-experts block (thinker: routed experts only; talker: + sigmoid-gated shared expert).

Expert weights are stored stacked per layer: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up)
and ``experts.down_proj [E, H, I]``; the loader fills them from the checkpoint's per-expert tensors.
On CUDA tensors (``use_kernels`` on, SiLU experts) the router and the experts run as Triton kernels
(``kernels.routing``, ``kernels.fused_moe``); ``route`` and ``run_experts`` here are the CPU path and the
reference they are tested against.

With a shared expert the fast path packs the four projections of the block's input (shared gate, shared up,
router, shared-expert gate) into one weight (``pack_projections_``): one linear launch for all four (at a
decode step's rows the multiply-add GEMV, ``fast_kernels.step_linear``), and the sigmoid-gated combine rides
on the experts' top-k sum launch (``fused_experts(shared=, shared_gate=)``). At one row a talker layer's
router, gate dot + reduce, shared gate/up, sigmoid, product and sum (7 launches) become 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.layers.fast_kernels import KernelSwitch, pack_linears_, step_linear
from omni_triton.models.layers.fp8_packed import is_fp8_linear
from omni_triton.models.layers.mlp import GatedMLP, activation
from omni_triton.models.layers.side_stream import SideBranch


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

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) for the torch path (FP8 experts dequantize them)."""
        return self.gate_up_proj, self.down_proj

    def fp8_scales(self) -> None:
        """The FP8 twin's block scales for the kernels (``layers.fp8.Fp8Experts``); None: plain weights."""
        return None


# The talker's packed input projection is 2 x 768 + 128 + 1 = 1665 rows: an odd-width product, for which cuBLAS
# ran a 9-us align1 kernel at 64 rows in every talker layer (benchmarks/results/h200-frame-sampler/
# graph_timeline_da3d8d6_served.json); padded to 1672 rows its output rows start 16-byte aligned.
PACKED_ROW_ALIGN = 8


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
        # [shared gate_proj; shared up_proj; router; shared_expert_gate; zero rows to a multiple of
        # PACKED_ROW_ALIGN] rows, with a shared expert
        self.packed_input_proj: torch.Tensor | None = None

    def pack_projections_(self) -> None:
        """One weight for every projection of the block's input; the nn.Linear weights become its row views
        (state dicts unchanged) and the shared expert's packed gate/up is its first rows, so that the shared
        expert (which ``set_fast_kernels`` visits after this block) does not pack its own. An FP8 shared expert
        does not join the router and its gate (model dtype): it packs its own gate/up where it can, the router and
        the gate keep their launches."""
        if (self.shared_expert is None or self.packed_input_proj is not None
                or is_fp8_linear(self.shared_expert.gate_proj)):
            return
        shared = self.shared_expert
        self.packed_input_proj, _ = pack_linears_([shared.gate_proj, shared.up_proj, self.gate,
                                                   self.shared_expert_gate], align_rows=PACKED_ROW_ALIGN)
        shared.packed_gate_up = (self.packed_input_proj[:2 * shared.gate_proj.out_features], None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels_for(x) and self.act is F.silu:
            return self.forward_with_kernels(x)
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = run_experts(x, *self.experts.dequantized(x.dtype), ids, weights, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward_with_kernels(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` through the Triton kernels, SiLU experts (any device Triton runs on: the interpreter on
        CPU in tests)."""
        from omni_triton.kernels import fused_moe, routing
        from omni_triton.kernels.activation import silu_and_mul

        shared = shared_gate = branch = None
        if self.packed_input_proj is not None:
            inter = self.shared_expert.gate_proj.out_features
            # column views of one [T, 2I + E + 1 + padding] output: the kernels below read rows at its stride
            projected = step_linear(self, x, self.packed_input_proj)
            router_end = 2 * inter + self.gate.out_features
            gate_up, router_logits = projected[:, :2 * inter], projected[:, 2 * inter:router_end]
            shared_gate = projected[:, router_end:router_end + 1]
            # the shared expert beside the routed ones (fused steps): off their critical path
            branch = SideBranch(x, enabled=self.use_fused_steps)
            with branch:
                shared = step_linear(self, silu_and_mul(gate_up), self.shared_expert.down_proj.weight)
        else:
            router_logits = step_linear(self, x, self.gate.weight)
        weights, ids = routing.route(router_logits, self.top_k, self.norm_topk_prob)
        gemv = self.use_fused_steps and self.linear_launch == "gemv"  # the per-pair GEMVs at 1-2 tokens
        per_pair = fused_moe.expert_pairs(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights,
                                          gemv=gemv, fp8_scales=self.experts.fp8_scales())
        if branch is not None:
            branch.join()
        out = fused_moe.sum_top_k(per_pair, self.top_k, shared, shared_gate)
        if self.shared_expert is not None and shared is None:  # not packed: the shared expert's own modules
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
