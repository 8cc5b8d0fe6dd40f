"""Tiny stand-in causal LMs for engine tests: the Thinker / Talker call surface of MODEL_API.md over
``AttentionBatch``, a few thousand random weights, and a no-cache reference generate to compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.layers.attention import contiguous_batch


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = pos[:, None].float() * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class ToyDecoder(nn.Module):
    def __init__(self, hidden: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_layers, self.num_kv_heads, self.head_dim, self.hidden_size = num_layers, num_kv_heads, head_dim, hidden
        self.num_heads = num_heads
        self.qkv = nn.ModuleList(nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim) for _ in range(num_layers))
        self.out = nn.ModuleList(nn.Linear(num_heads * head_dim, hidden) for _ in range(num_layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
                                 for _ in range(num_layers))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, batch, capture_layers=()):
        pos = positions[0] if positions.dim() == 2 else positions
        captured = {0: h} if 0 in capture_layers else {}
        for i in range(self.num_layers):
            x = F.rms_norm(h, (h.shape[-1],))
            q, k, v = self.qkv[i](x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                            self.num_kv_heads * self.head_dim], dim=-1)
            q = _rope(q.view(-1, self.num_heads, self.head_dim), pos)
            k = _rope(k.view(-1, self.num_kv_heads, self.head_dim), pos)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            h = h + self.out[i](batch.attend(i, q, k, v).flatten(1))
            h = h + self.mlp[i](F.rms_norm(h, (h.shape[-1],)))
            if i + 1 in capture_layers:
                captured[i + 1] = h
        return F.rms_norm(h, (h.shape[-1],)), captured


class ToyThinker(nn.Module):
    """embed / forward(capture_layers) / compute_logits, like omni_triton.models.thinker.Thinker."""

    def __init__(self, vocab: int = 64, hidden: int = 32, num_layers: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size = vocab
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.decoder = ToyDecoder(hidden, num_layers, num_heads=4, num_kv_heads=2, head_dim=8)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=1.0)
        self.num_layers, self.num_kv_heads = num_layers, 2
        self.head_dim, self.hidden_size = 8, hidden

    def embed(self, input_ids):
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds, positions, batch, capture_layers=()):
        return self.decoder(inputs_embeds, positions, batch, capture_layers)

    def compute_logits(self, hidden):
        return self.lm_head(hidden).float()


class ToyTalker(nn.Module):
    """forward / compute_logits / predict_frame(hidden, code0, sample_fn), like models.talker.Talker."""

    def __init__(self, vocab: int = 48, hidden: int = 32, num_layers: int = 2, num_code_groups: int = 4,
                 seed: int = 1):
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size, self.num_code_groups = vocab, num_code_groups
        self.decoder = ToyDecoder(hidden, num_layers, num_heads=4, num_kv_heads=2, head_dim=8)
        self.codec_head = nn.Linear(hidden, vocab, bias=False)
        nn.init.normal_(self.codec_head.weight, std=1.0)
        self.codec_embedding = nn.Embedding(vocab, hidden)
        self.residual_heads = nn.ModuleList(nn.Linear(hidden, vocab) for _ in range(num_code_groups - 1))
        self.residual_embeddings = nn.ModuleList(nn.Embedding(vocab, hidden) for _ in range(num_code_groups - 1))
        self.num_layers, self.num_kv_heads = num_layers, 2
        self.head_dim, self.hidden_size = 8, hidden

    def forward(self, inputs_embeds, positions, batch):
        return self.decoder(inputs_embeds, positions, batch)[0]

    def compute_logits(self, hidden):
        return self.codec_head(hidden).float()

    def predict_frame(self, hidden, code0, sample_fn):
        state = hidden + self.codec_embedding(code0)
        codes, embeds = [code0], [self.codec_embedding(code0)]
        for group in range(1, self.num_code_groups):
            code = sample_fn(self.residual_heads[group - 1](state).float() * 3, group)
            embed = self.residual_embeddings[group - 1](code)
            state = state + embed
            codes.append(code)
            embeds.append(embed)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(dim=1)


@torch.no_grad()
def reference_greedy(model: ToyThinker | nn.Module, prompt: list[int], max_new_tokens: int,
                     stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """No KV reuse: re-run the whole sequence each step through the reference attention path."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        batch = contiguous_batch([len(ids)], model.num_layers, model.num_kv_heads, model.head_dim,
                                 dtype=torch.float32, block_size=4)
        batch.use_reference = True
        hidden, _ = model(model.embed(torch.tensor(ids)), torch.arange(len(ids)), batch)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        ids.append(token)
        if token in stop_token_ids:
            break
    return out
