"""Code2Wav: the vocoder that turns codec frames [B, G, N] into a 24 kHz waveform.

codes -> mean of the G codebook embeddings -> sliding-window causal transformer ("pre-transformer")
-> 2x (transposed conv upsampling + ConvNeXt block) -> conv + decoder blocks (SnakeBeta, transposed conv,
dilated residual units) -> SnakeBeta + conv -> waveform clamped to +-1.

Module and parameter names mirror the checkpoint's ``code2wav.*`` tensors so loading is a plain strict
``load_state_dict`` after stripping the prefix. Every convolution is causal except the transposed convs,
which look one input step ahead; that lookahead is why N frames yield ``N * samples_per_frame - trim``
samples (1920 N - 555 at full size): the last ``trim`` samples would need frames that do not exist yet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.code2wav.phase_conv import dilated_conv_as_phases
from omni_triton.models.layers.fast_kernels import KernelSwitch


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int

    @classmethod
    def from_dict(cls, raw: dict) -> "Code2WavConfig":
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"code2wav_config.hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("attention_bias", False):
            raise ValueError("code2wav_config.attention_bias=True is not supported")
        rope = raw.get("rope_parameters") or {}
        heads = raw["num_attention_heads"]
        return cls(
            codebook_size=raw["codebook_size"], num_quantizers=raw["num_quantizers"],
            hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"], sliding_window=raw["sliding_window"],
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=raw["rms_norm_eps"], upsampling_ratios=tuple(raw["upsampling_ratios"]),
            upsample_rates=tuple(raw["upsample_rates"]), decoder_dim=raw["decoder_dim"],
        )

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> "Code2WavConfig":
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        if "code2wav_config" not in config:
            raise ValueError(f"{checkpoint_dir}/config.json has no 'code2wav_config'")
        return cls.from_dict(config["code2wav_config"])


# ---------------------------------------------------------------- convolution blocks

# How a block runs its convolutions: ``run(conv, x)``. The one-pass decode calls the module; the streaming
# decoder (code2wav_streaming) passes a runner that prepends each conv's state from the previous chunk.
ConvRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def call_module(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return conv(x)


class CausalConv1d(nn.Module):
    """Stride-1 conv padded on the left only, so output t sees inputs <= t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation
        # a dilated conv over its input's phases (phase_conv.py); set by the torch runtime on a GPU, the same sums
        self.phase_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_padded(F.pad(x, (self.left_pad, 0)))

    def conv_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """The conv of an input that already has its ``left_pad`` past steps (zeros, or a stream's state)."""
        if self.phase_split and self.conv.dilation[0] > 1:
            return dilated_conv_as_phases(self.conv, padded)
        return self.conv(padded)


def set_phase_split(model: nn.Module, enabled: bool) -> int:
    """Every ``CausalConv1d`` of ``model`` over its input's phases, or not (``phase_split``); returns how many of them
    are dilated (those it changes)."""
    convs = [module for module in model.modules() if isinstance(module, CausalConv1d)]
    for conv in convs:
        conv.phase_split = enabled
    return sum(conv.conv.dilation[0] > 1 for conv in convs)


class CausalTransConv1d(nn.Module):
    """Upsample by ``stride``; the ``kernel - stride`` overhang is cut equally from both ends.

    With kernel 2*stride, trimmed output t depends on inputs t//stride and t//stride + 1 (one step of
    lookahead), and L inputs give (L - 1) * stride outputs.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim:x.shape[-1] - self.trim] if self.trim else x


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, run: ConvRunner = call_module) -> torch.Tensor:  # [B, C, T]
        h = run(self.dwconv, x).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class SnakeBeta(KernelSwitch, nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (alpha, beta stored in log scale).

    The torch code below is the CPU path and the reference; with ``use_kernels`` on, CUDA tensors take the fused
    kernel (``kernels.snake``: one launch for the five to six here, computed in fp32 and rounded once)."""

    # off here (the CPU path); the torch runtime on CUDA switches it on with ``triton_snake`` (--code2wav-triton-snake,
    # on by default)
    use_kernels = False

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        if self.kernels_for(x):
            from omni_triton.kernels.snake import snake_beta

            return snake_beta(x, self.alpha, self.beta)
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, run: ConvRunner = call_module) -> torch.Tensor:
        return x + run(self.conv2, self.act2(run(self.conv1, self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta -> upsample by ``rate`` (halving channels) -> residual units with dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransConv1d(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)])

    def forward(self, x: torch.Tensor, run: ConvRunner = call_module) -> torch.Tensor:
        snake, upsample, *units = self.block
        x = run(upsample, snake(x))
        for unit in units:
            x = unit(x, run)
        return x


# ---------------------------------------------------------------- pre-transformer

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # at least fp32, as transformers' norm; an fp64 model stays fp64: rounded to fp32, two inputs 1e-16 apart
        # can land on either side of an fp32 step, which the fp64 streaming tests read as a 1e-8 state error
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


# Streaming attention: (this chunk's k, v) -> (cached + this chunk's k, v), [B, kv_heads, T, head_dim] each.
KVCache = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SlidingWindowAttention(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:  # streaming: the previous chunks' keys and values go first
            k, v = kv_cache(k, v)
        if self.num_kv_heads != self.num_heads:
            repeats = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SlidingWindowAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None = None):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PreTransformer(nn.Module):
    """Causal transformer where frame t attends to frames t - window + 1 .. t."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sliding_window = config.sliding_window
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, H]
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rope(positions, x.dtype)
        offset = positions[:, None] - positions[None, :]  # query - key
        mask = (offset >= 0) & (offset < self.sliding_window)
        return self.run_layers(x, cos, sin, mask)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] (absolute frame indices) -> cos, sin [..., T, head_dim]."""
        # computed here (not a buffer) in fp32, or fp64 for an fp64 model, so low-precision models keep
        # accurate rotary angles
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device, dtype=angle_dtype) / self.head_dim
        freqs = positions[..., None].to(angle_dtype) * (1.0 / self.rope_theta ** exponents)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def run_layers(self, x, cos, sin, mask, kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if kv_caches is None else kv_caches[index])
        return self.norm(x)


# ---------------------------------------------------------------- the vocoder

class Code2Wav(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.config = config
        self.num_quantizers = config.num_quantizers
        self.sliding_window = config.sliding_window
        self.samples_per_frame = self.samples_per_frame_for(config)
        self.trim_samples = self.trim_samples_for(config)

        self.code_embedding = nn.Embedding(code_embedding_rows(config), config.hidden_size)
        self.register_buffer("code_offset", torch.arange(config.num_quantizers).view(1, -1, 1) * config.codebook_size,
                             persistent=False)
        self.pre_transformer = PreTransformer(config)
        hidden = config.hidden_size
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(hidden, hidden, factor, factor), ConvNeXtBlock(hidden)])
            for factor in config.upsampling_ratios)
        dims = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(hidden, config.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], rate) for i, rate in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)])

    @staticmethod
    def samples_per_frame_for(config: Code2WavConfig) -> int:
        return math.prod(config.upsampling_ratios) * math.prod(config.upsample_rates)

    @staticmethod
    def trim_samples_for(config: Code2WavConfig) -> int:
        """Samples one pass cannot produce at the end (555 at the released rates 8/5/4/3)."""
        # each decoder block turns L steps into (L - 1) * rate: one step of its input is lost per block
        lost, rate_after = 0, 1
        for rate in reversed(config.upsample_rates):
            rate_after *= rate
            lost += rate_after
        return lost

    def output_length(self, num_frames: int) -> int:
        return num_frames * self.samples_per_frame - self.trim_samples

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes LongTensor [B, G, N] -> waveform [B, N * samples_per_frame - trim_samples] in [-1, 1]."""
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [B, {self.num_quantizers}, N], got {tuple(codes.shape)}")
        return self.vocode(self.pre_transformer(self.embed(codes)))

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, N] -> the mean of the G codebook embeddings [B, N, H]."""
        return self.code_embedding(codes + self.code_offset).mean(1)

    def vocode(self, hidden: torch.Tensor, run: ConvRunner = call_module) -> torch.Tensor:
        """The pre-transformer's output [B, N, H] -> waveform [B, S] in [-1, 1] (the conv stack)."""
        hidden = hidden.transpose(1, 2)  # [B, H, N]
        for upsample, convnext in self.upsample:
            hidden = convnext(run(upsample, hidden), run)
        first_conv, *blocks, snake, last_conv = self.decoder
        hidden = run(first_conv, hidden)
        for block in blocks:
            hidden = block(hidden, run)
        hidden = run(last_conv, snake(hidden))
        return hidden.squeeze(1).clamp(-1.0, 1.0)


def code_embedding_rows(config: Code2WavConfig) -> int:
    """Rows of the code embedding table: one block of ``codebook_size`` rows per quantizer."""
    return config.codebook_size * config.num_quantizers


def check_code_range(codes: torch.Tensor, codebook_size: int, embedding_rows: int) -> None:
    """Raise ValueError for a code the vocoder cannot embed. Quantizer q's code c reads row ``c + q *
    codebook_size`` of one shared table, as in transformers' Code2Wav, so a code past ``codebook_size`` is
    decoded with the next quantizer's rows (the talker can emit such first codes when its vocabulary is larger
    than the codebook, and transformers decodes them so); only rows outside the table fail, there too.
    ``codes``: [..., G, N]."""
    offsets = torch.arange(codes.shape[-2], device=codes.device).view(-1, 1) * codebook_size
    rows = codes + offsets
    outside = (rows < 0) | (rows >= embedding_rows)
    if bool(outside.any()):
        index = tuple(int(i) for i in outside.nonzero()[0])
        code, (quantizer, frame) = int(codes[index]), index[-2:]
        raise ValueError(f"CODES: quantizer {quantizer}'s code {code} (frame {frame}) reads row "
                         f"{code + quantizer * codebook_size} of the code embedding table, which has rows "
                         f"[0, {embedding_rows - 1}] (code + quantizer * {codebook_size}, as transformers' Code2Wav "
                         "indexes it: it fails on this code too)")


def exact_left_context_frames(config: Code2WavConfig) -> int:
    """Frames of left context that make a chunk's new samples bit-for-bit those of a one-pass decode.

    Walks the receptive field back from the first sample a streaming chunk returns (the first one the
    previous chunk could not produce: ``frame_start * samples_per_frame - trim``) to the earliest frame
    it depends on, through the conv stack (left pads, dilations, transposed-conv index maps) and then
    ``num_hidden_layers * (sliding_window - 1)`` frames of the pre-transformer.
    """
    spf = Code2Wav.samples_per_frame_for(config)
    trim = Code2Wav.trim_samples_for(config)
    start_frame = 10 * (config.num_hidden_layers * config.sliding_window + 100)  # far from the zero edge
    index = start_frame * spf - trim  # earliest sample needed, at the output rate
    index -= 6  # final CausalConv1d(k=7)
    for rate in reversed(config.upsample_rates):
        index -= 6 * (1 + 3 + 9)  # residual units' dilated k=7 convs
        index = index // rate  # trimmed transposed conv: output t needs input t // rate (and the next one)
    index -= 6  # first decoder CausalConv1d(k=7)
    for factor in reversed(config.upsampling_ratios):
        index -= 6  # ConvNeXt depthwise k=7
        index = index // factor  # kernel == stride transposed conv: output t needs input t // factor
    index -= config.num_hidden_layers * (config.sliding_window - 1)
    return start_frame - index
