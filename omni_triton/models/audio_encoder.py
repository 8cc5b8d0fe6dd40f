"""The thinker's audio encoder: log-mel features -> one embedding per audio token (thinker hidden size).

Each audio's features are cut into chunks of ``2 * n_window`` frames (the last one shorter); every chunk
goes through three stride-2 conv2d layers (8x fewer frames: 100 -> 13) and gets sinusoidal positions that
restart at 0 in each chunk. Tokens then attend bidirectionally within windows of
``n_window_infer // (2 * n_window)`` whole chunks of the same audio; LayerNorm + 2-layer projection to the
thinker's hidden size follow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.audio_features import HOP_LENGTH


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    output_dim: int
    n_window: int
    n_window_infer: int
    max_source_positions: int
    downsample_hidden_size: int

    @classmethod
    def from_dict(cls, raw: dict) -> "AudioEncoderConfig":
        if raw.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"audio_config.activation_function={raw['activation_function']!r} is not supported")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> "AudioEncoderConfig":
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        try:
            return cls.from_dict(config["thinker_config"]["audio_config"])
        except KeyError as missing:
            raise ValueError(f"{checkpoint_dir}/config.json: thinker_config.audio_config lacks {missing}") from None


def conv_output_length(num_frames: torch.Tensor | int) -> torch.Tensor | int:
    """Frames left after the three stride-2, padding-1, kernel-3 convs."""
    for _ in range(3):
        num_frames = (num_frames - 1) // 2 + 1
    return num_frames


def num_audio_tokens(feature_lengths: torch.Tensor | int, n_window: int = 50) -> torch.Tensor | int:
    """Audio tokens the encoder emits for ``feature_lengths`` mel frames (HF ``_get_feat_extract_output_lengths``):
    whole chunks of ``2 * n_window`` frames give ``conv_output_length(2 * n_window)`` each, plus the remainder's."""
    chunk = 2 * n_window
    return conv_output_length(feature_lengths % chunk) + (feature_lengths // chunk) * conv_output_length(chunk)


def num_audio_tokens_for_samples(num_samples: int, n_window: int = 50) -> int:
    """Audio tokens a 16 kHz waveform of ``num_samples`` yields (one log-mel frame per 160 samples)."""
    return num_audio_tokens(num_samples // HOP_LENGTH, n_window)


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None].float() * inv_timescales[None, :]
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1)


class EncoderAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [W, L, D] (windows padded to L), key_mask [W, L] bool -> [W, L, D]."""
        windows, length, dim = x.shape
        shape = (windows, length, self.num_heads, dim // self.num_heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out_proj(out.transpose(1, 2).reshape(windows, length, dim))


class EncoderLayer(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.self_attn = EncoderAttention(config.d_model, config.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.config = config
        hidden = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(hidden * conv_output_length(config.num_mel_bins), config.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.proj2 = nn.Linear(config.d_model, config.output_dim)
        self.register_buffer("positions", sinusoid_positions(config.max_source_positions, config.d_model),
                             persistent=False)

    @property
    def chunk_frames(self) -> int:
        return 2 * self.config.n_window

    @property
    def window_tokens(self) -> int:
        """Tokens per attention window: ``n_window_infer // chunk_frames`` whole chunks."""
        return conv_output_length(self.chunk_frames) * (self.config.n_window_infer // self.chunk_frames)

    def num_tokens(self, feature_lengths: torch.Tensor | int) -> torch.Tensor | int:
        return num_audio_tokens(feature_lengths, self.config.n_window)

    def forward(self, features: torch.Tensor, feature_lengths: torch.Tensor | list[int]) -> torch.Tensor:
        """features [B, num_mel_bins, T] (padded past each length) -> [sum of num_tokens(lengths), output_dim],
        the audios' tokens concatenated in batch order."""
        lengths = [int(n) for n in feature_lengths]
        if features.dim() != 3 or features.shape[1] != self.config.num_mel_bins or len(lengths) != features.shape[0]:
            raise ValueError(f"features must be [{len(lengths)}, {self.config.num_mel_bins}, T], "
                             f"got {tuple(features.shape)}")
        chunks = [piece for audio, n in zip(features, lengths)
                  for piece in audio[:, :n].split(self.chunk_frames, dim=1)]
        chunk_lens = [c.shape[1] for c in chunks]
        padded = torch.nn.utils.rnn.pad_sequence([c.T for c in chunks], batch_first=True)  # [C, L, mel]
        x = padded.transpose(1, 2).unsqueeze(1).to(self.conv2d1.weight.dtype)  # [C, 1, mel, L]
        x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x))))))
        num_chunks, channels, freq, steps = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(num_chunks, steps, channels * freq))
        x = x + self.positions[:steps].to(x.dtype)
        tokens = torch.cat([x[i, :conv_output_length(n)] for i, n in enumerate(chunk_lens)])

        windows = [w for n in lengths for w in self._window_sizes(self.num_tokens(n))]
        hidden = torch.nn.utils.rnn.pad_sequence(tokens.split(windows), batch_first=True)  # [W, Lw, D]
        key_mask = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < torch.tensor(
            windows, device=hidden.device)[:, None]
        for layer in self.layers:
            hidden = layer(hidden, key_mask)
        hidden = hidden[key_mask]
        return self.proj2(F.gelu(self.proj1(self.ln_post(hidden))))

    def _window_sizes(self, num_tokens: int) -> list[int]:
        full, rest = divmod(num_tokens, self.window_tokens)
        return [self.window_tokens] * full + ([rest] if rest else [])


def scatter_audio_embeddings(inputs_embeds: torch.Tensor, input_ids: torch.Tensor, audio_token_id: int,
                             audio_embeds: torch.Tensor) -> torch.Tensor:
    """Put the audio embeddings, in order, at the prompt's ``audio_token_id`` positions (out of place).

    inputs_embeds [T, H], input_ids [T], audio_embeds [A, H] with A == number of audio tokens in the prompt.
    """
    positions = (input_ids == audio_token_id).nonzero().squeeze(-1)
    if positions.numel() != audio_embeds.shape[0]:
        raise ValueError(f"prompt has {positions.numel()} audio tokens (id {audio_token_id}) but "
                         f"{audio_embeds.shape[0]} audio embeddings were given")
    return inputs_embeds.index_copy(0, positions, audio_embeds.to(inputs_embeds.dtype))
