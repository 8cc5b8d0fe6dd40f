"""Talker: the MoE codec LM (shared expert per layer) plus its text/hidden projections and code predictor."""

from __future__ import annotations

import torch
from torch import nn

from omni_triton.models.code_predictor import CodePredictor, SampleFn, greedy
from omni_triton.models.config import TalkerConfig
from omni_triton.models.layers.decoder import DecoderStack
from omni_triton.models.layers.mlp import ResizeMLP

# The top 1024 ids of the talker vocab are control codes; only EOS may be generated among them.
NUM_CONTROL_CODES = 1024


class TalkerTextModel(DecoderStack):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Talker(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        text = config.text
        self.config = config
        self.num_layers, self.num_kv_heads = text.num_layers, text.num_kv_heads
        self.head_dim, self.hidden_size, self.vocab_size = text.head_dim, text.hidden_size, text.vocab_size
        self.num_code_groups = config.num_code_groups
        self.model = TalkerTextModel(text)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size,
                                         text.hidden_act)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size,
                                           text.hidden_act)
        self.code_predictor = CodePredictor(config.code_predictor, config.num_code_groups)

    def project_text(self, thinker_input_embeds: torch.Tensor) -> torch.Tensor:
        return self.text_projection(thinker_input_embeds)

    def project_hidden(self, thinker_hidden: torch.Tensor) -> torch.Tensor:
        return self.hidden_projection(thinker_hidden)

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        return self.model(inputs_embeds, positions, batch)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def suppressed_token_ids(self) -> torch.Tensor:
        ids = torch.arange(self.vocab_size - NUM_CONTROL_CODES, self.vocab_size)
        return ids[ids != self.config.codec_eos_token_id]

    @torch.no_grad()
    def predict_frame(self, hidden: torch.Tensor, code0: torch.Tensor,
                      sample_fn: SampleFn = greedy) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] (talker final hidden that produced code0), code0 [B] ->
        (codes [B, G] with code0 first, next codec embeds [B, H] = sum of the frame's G codebook embeddings)."""
        code0_embeds = self.embed_codec(code0)
        residual_codes, residual_embeds = self.code_predictor.predict(hidden, code0_embeds, sample_fn)
        codes = torch.cat((code0[:, None], residual_codes), dim=1)
        next_embeds = torch.stack([code0_embeds, *residual_embeds], dim=1).sum(dim=1)
        return codes, next_embeds
