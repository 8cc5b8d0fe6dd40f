"""Code predictor (MTP): a small dense decoder that fills the residual codebooks 1..G-1 of one frame.

Per frame and row: prefill [talker final hidden, embed(code0)] -> code 1 (lm_head[0]); then feeding
codec_embedding[g-1](code g) -> code g+1 (lm_head[g]). Every row of a batch is at the same step, so the
KV cache is a tiny contiguous ``[B, G+1, kv_heads, head_dim]`` per layer, built fresh for each frame.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.config import TextModelConfig
from omni_triton.models.layers.decoder import DecoderStack

# sample_fn(logits [B, vocab] float32, group) -> codes [B]; ``group`` is the codebook being picked (1..G-1)
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, group: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


class FrameCache:
    """KV cache of one frame for B rows that all advance together (duck-types ``AttentionBatch.attend``).

    Stored head-major (``[layers, B, kv_heads, len, head_dim]``) so attention reads it in place, with the
    query-head groups handled by SDPA (no repeated K/V): a handful of launches per layer, which is what one
    frame's 15 steps inside a CUDA graph are made of."""

    def __init__(self, num_layers: int, rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, rows, num_kv_heads, max_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.rows = rows
        self.length = 0  # tokens already cached per row before the current step

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        rows, new = self.rows, q.shape[0] // self.rows
        end = self.length + new
        self.keys[layer_idx, :, :, self.length:end] = k.view(rows, new, *k.shape[1:]).transpose(1, 2)
        self.values[layer_idx, :, :, self.length:end] = v.view(rows, new, *v.shape[1:]).transpose(1, 2)
        queries = q.view(rows, new, *q.shape[1:]).transpose(1, 2)  # [B, Hq, new, D]
        mask = None
        if new > 1:  # query j sits at position length + j
            q_pos = torch.arange(self.length, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(queries, self.keys[layer_idx, :, :, :end],
                                             self.values[layer_idx, :, :, :end], attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(q.shape)

    def advance(self, new: int) -> None:
        self.length += new


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: TextModelConfig, num_code_groups: int):
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: TextModelConfig, num_code_groups: int):
        super().__init__()
        if cfg.mrope_section is not None:
            raise ValueError("code predictor uses plain 1-D RoPE; got an mrope_section")
        self.config = cfg
        self.num_code_groups = num_code_groups
        self.model = CodePredictorModel(cfg, num_code_groups)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(num_code_groups - 1))

    @torch.no_grad()
    def predict(self, talker_hidden: torch.Tensor, code0_embeds: torch.Tensor,
                sample_fn: SampleFn = greedy) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """talker_hidden, code0_embeds [B, H] -> (residual codes [B, G-1], their embeddings G-1 x [B, H])."""
        rows, hidden_size = talker_hidden.shape
        cfg = self.config
        cache = FrameCache(cfg.num_layers, rows, self.num_code_groups + 1, cfg.num_kv_heads, cfg.head_dim,
                           talker_hidden.dtype, talker_hidden.device)
        x = torch.stack((talker_hidden, code0_embeds), dim=1).reshape(rows * 2, hidden_size)
        positions = torch.arange(2, device=x.device).repeat(rows)
        codes, embeds = [], []
        for group in range(1, self.num_code_groups):
            hidden, _ = self.model(x, positions, cache)
            cache.advance(x.shape[0] // rows)
            last = hidden.view(rows, -1, hidden_size)[:, -1]
            code = sample_fn(self.lm_head[group - 1](last).float(), group)
            codes.append(code)
            x = self.model.codec_embedding[group - 1](code)
            embeds.append(x)
            positions = torch.full((rows,), cache.length, dtype=torch.long, device=x.device)
        return torch.stack(codes, dim=1), embeds
