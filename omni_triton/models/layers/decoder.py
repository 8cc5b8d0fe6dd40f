"""The Qwen3 decoder block shared by thinker, talker and code predictor.

Pre-norm attention (q/k RMSNorm per head before RoPE, GQA through ``batch.attend``) and a feed-forward that
is a SparseMoE or a dense GatedMLP per layer. Inputs are flat token batches ``[T, H]``. On CUDA the q/k norm
and rotary run as one kernel for q and k, and each residual add joins the norm after it (``kernels.norm``:
the post-attention norm, the next layer's input norm, the final norm; a layer hands the next its feed-forward
output and residual stream unsummed); at a decode step's few rows the packed qkv and o_proj are multiply-add
GEMVs (``fast_kernels.step_linear``). FP8 q/k/v pack where their block scales stack (``layers.fp8_packed``).
"""

from __future__ import annotations

import torch
from torch import nn

from omni_triton.models.config import TextModelConfig
from omni_triton.models.layers.fast_kernels import KernelSwitch, pack_linears_, step_linear
from omni_triton.models.layers.fp8_packed import PackedFp8Linear, is_fp8_linear, pack_fp8_linears_
from omni_triton.models.layers.mlp import GatedMLP
from omni_triton.models.layers.moe import SparseMoE
from omni_triton.models.layers.norm import RMSNorm
from omni_triton.models.layers.rope import RotaryEmbedding, apply_rotary


class SelfAttention(KernelSwitch, nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.packed_qkv: tuple[torch.Tensor, torch.Tensor | None] | PackedFp8Linear | None = None

    def pack_projections_(self) -> None:
        if self.packed_qkv is None:
            parts = [self.q_proj, self.k_proj, self.v_proj]
            # FP8: packed where the block scales stack, else (None) their own launches
            self.packed_qkv = pack_fp8_linears_(parts) if is_fp8_linear(self.q_proj) else pack_linears_(parts)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.kernels_for(x) and self.packed_qkv is not None:
            sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
            qkv = (self.packed_qkv(x) if isinstance(self.packed_qkv, PackedFp8Linear)
                   else step_linear(self, x, *self.packed_qkv))
            q, k, v = qkv.split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kernels_for(x):
            from omni_triton.kernels.norm import qk_norm_rope

            # with the fused steps, a batch that lets it (graph steps) takes K/V from this kernel: k comes back
            # None, the step's K/V already in the cache
            store = batch.kv_store(self.layer_idx) if self.use_fused_steps else None
            q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps,
                                self.k_norm.eps, store=None if store is None else (v, *store))
        else:
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        out = batch.attend(self.layer_idx, q, k, v, scale=self.head_dim ** -0.5).reshape(num_tokens, -1)
        if self.kernels_for(x) and not is_fp8_linear(self.o_proj):  # FP8: its own kernel
            return step_linear(self, out, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                 cfg.shared_expert_intermediate_size, cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(feed-forward output, residual stream before it): the layer's output is their sum, left to the next
        norm's ``add_forward`` (one launch for the add and the norm, as the post-attention norm does). ``x`` is
        the previous layer's feed-forward output with ``residual`` its residual stream, or (None) the input."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        attended = self.self_attn(h, cos, sin, batch)
        h, residual = self.post_attention_layernorm.add_forward(attended, residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    """Layers + final norm. Module names match the checkpoint's ``<component>.model.*``."""

    def __init__(self, cfg: TextModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch,
                capture_layers=()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, H], positions [T] or [3, T] -> (normed final hidden, {k: hidden_states[k]}).

        ``k`` follows transformers' ``hidden_states[k]``: 0 = inputs, k = output of layer k-1 (unnormed),
        except k = num_layers, which transformers ties to the *normed* final output."""
        num_layers = len(self.layers)
        for k in capture_layers:
            if not 0 <= k <= num_layers:
                raise ValueError(f"capture layer {k} is outside 0..{num_layers}")
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured = {0: x} if 0 in capture_layers else {}
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, cos, sin, batch, residual)
            if i + 1 in capture_layers and i + 1 < num_layers:
                captured[i + 1] = residual + x  # the layer's output (the next norm adds it again, the same bits)
        x, _ = self.norm.add_forward(x, residual)
        if num_layers in capture_layers:
            captured[num_layers] = x
        return x, captured
