"""Thinker: the MoE text LLM (plus, optionally, its audio encoder) over flat varlen token batches."""

from __future__ import annotations

import torch
from torch import nn

from omni_triton.models.config import ThinkerConfig
from omni_triton.models.layers.decoder import DecoderStack


class ThinkerTextModel(DecoderStack):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Thinker(nn.Module):
    def __init__(self, config: ThinkerConfig, audio_encoder: nn.Module | None = None):
        super().__init__()
        text = config.text
        self.config = config
        self.num_layers, self.num_kv_heads = text.num_layers, text.num_kv_heads
        self.head_dim, self.hidden_size, self.vocab_size = text.head_dim, text.hidden_size, text.vocab_size
        self.model = ThinkerTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.audio_encoder = audio_encoder

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, batch,
                capture_layers=()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        return self.model(inputs_embeds, positions, batch, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
