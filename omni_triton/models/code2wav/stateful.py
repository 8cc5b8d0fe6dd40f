"""Stateful streaming Code2Wav: each chunk decodes only its new frames, and the samples equal a one-pass decode.

The vocoder is causal, so a chunk's new samples depend on the past only through a bounded state per layer:

- each pre-transformer layer: the keys (after RoPE) and values of the last ``sliding_window - 1`` frames;
- each causal conv (kernel k, dilation d): its last ``(k - 1) * d`` inputs;
- each decoder block's transposed conv (kernel 2r, stride r): its last input. Output block j of such a conv is
  built from inputs j and j + 1, so the block pairing the previous chunk's last input with this chunk's first
  one is due now; a stream's first chunk has no such block (the one-pass decode trims it);
- the frames decoded so far (RoPE positions, and "is this the stream's first chunk").

The upsampling transposed convs (kernel == stride) look nowhere else and keep no state. ``decode`` runs the
same modules as ``Code2Wav.forward`` (``Code2Wav.vocode`` with a conv runner that prepends each conv's state;
the attention with a KV cache), so after chunks of n_1, n_2, ... frames the samples out are exactly those a
one-pass decode of n_1 + n_2 + ... frames gives: ``output_length(N)`` in all, nothing held back beyond what the
one pass itself cannot produce (the last frame's lookahead, ``trim_samples``), so there is nothing to flush.

Batching: row b of a call holds ``lengths[b]`` new frames, right-padded to the longest row. Everything is causal,
so padding only produces samples past the row's own count (dropped); each state is read at the row's own end
(a gather), never from the padding. Rows may be at any point of their streams (a first chunk beside a later
one). All bookkeeping is on the device: no host sync inside a call.

State layout (``state_specs``): a flat list of tensors, each with a leading batch dim: ``positions`` [B] int64,
then per transformer layer its keys and values, then per stateful conv its past inputs, in call order. Flat so
it maps 1:1 onto ONNX inputs/outputs and onto a served stage's per-stream slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omni_triton.models.code2wav.vocoder import CausalConv1d, CausalTransConv1d, Code2Wav


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]  # per stream: without the batch dim
    dtype: torch.dtype


POSITIONS = "positions"
# exported I/O names besides the state's own (ONNX, TensorRT)
CODES_NAME, LENGTHS_NAME, WAVEFORM_NAME = "codes", "lengths", "waveform"
NEW_STATE_PREFIX = "new_"  # output name of each state tensor's next value


class StreamingCode2Wav(nn.Module):
    """``forward(codes, lengths, *state) -> (waveform, *new_state)`` around a ``Code2Wav`` (its weights, shared).

    codes [B, G, T] int64 (row b's first ``lengths[b]`` frames are new frames, the rest padding); lengths [B]
    int64 (0: the row's state comes back unchanged); state: ``state_specs()`` order. waveform [B, T * samples_per_frame]: row b's first
    ``new_samples(positions[b], lengths[b])`` samples are its new audio.
    """

    def __init__(self, model: Code2Wav):
        super().__init__()
        if model.output_length(1) < 1:
            raise ValueError("a one-frame first chunk must yield samples (output_length(1) >= 1) for streaming")
        self.model = model
        self.samples_per_frame = model.samples_per_frame
        self.trim_samples = model.trim_samples
        self.cache_frames = model.sliding_window - 1
        # the conv stack's stateful layers in call order (Code2Wav.vocode's); the transformer's come first
        self.stateful_convs = [m for m in model.modules()
                               if (isinstance(m, CausalConv1d) and m.left_pad > 0)
                               or (isinstance(m, CausalTransConv1d) and m.trim > 0)]
        for m in model.modules():
            if isinstance(m, CausalTransConv1d):
                kernel, stride = m.conv.kernel_size[0], m.conv.stride[0]
                if kernel not in (stride, 2 * stride):
                    raise ValueError(f"transposed conv kernel {kernel}, stride {stride}: streaming handles kernel "
                                     "== stride or 2 * stride only")

    # ---------------------------------------------------------------- state

    def state_specs(self) -> list[StateSpec]:
        model = self.model
        dtype = model.code_embedding.weight.dtype
        attention = model.pre_transformer.layers[0].self_attn
        kv_shape = (attention.num_kv_heads, self.cache_frames, attention.head_dim)
        specs = [StateSpec(POSITIONS, (), torch.int64)]
        for index in range(len(model.pre_transformer.layers)):
            specs += [StateSpec(f"layer{index}_keys", kv_shape, dtype),
                      StateSpec(f"layer{index}_values", kv_shape, dtype)]
        names = {module: name for name, module in model.named_modules()}
        for conv in self.stateful_convs:
            width = conv.left_pad if isinstance(conv, CausalConv1d) else 1
            specs.append(StateSpec(names[conv].replace(".", "_"), (conv.conv.in_channels, width), dtype))
        return specs

    def initial_state(self, batch: int, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """A fresh stream's state: zeros (a causal conv's zero left padding; no cached keys: positions 0)."""
        device = device if device is not None else self.model.code_embedding.weight.device
        return [torch.zeros(batch, *spec.shape, dtype=spec.dtype, device=device) for spec in self.state_specs()]

    def new_samples(self, positions: int, lengths: int) -> int:
        return chunk_samples(self.samples_per_frame, self.trim_samples, positions, lengths)

    # ---------------------------------------------------------------- decode

    def forward(self, codes: torch.Tensor, lengths: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.model
        positions, kv_end = state[0], 1 + 2 * len(model.pre_transformer.layers)
        hidden, new_layer_states = self._transformer(model.embed(codes), lengths, positions, list(state[1:kv_end]))
        runner = _StatefulConvRunner(self.stateful_convs, list(state[kv_end:]), lengths, fresh=positions == 0)
        waveform = model.vocode(hidden, runner)
        runner.check_done()
        return (waveform, positions + lengths, *new_layer_states, *runner.new_states)

    def _transformer(self, hidden: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                     layer_states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        transformer, cached = self.model.pre_transformer, self.cache_frames
        frames = hidden.shape[1]
        steps = torch.arange(frames, device=hidden.device)
        cos, sin = transformer.rope(positions[:, None] + steps, hidden.dtype)  # [B, T, D]
        # key c of cat(cache, new) sits at frame positions - cached + c; query i at positions + i
        keys = torch.arange(cached + frames, device=hidden.device)
        offset = steps[:, None] + cached - keys[None, :]  # query - key, [T, cached + T]
        in_window = (offset >= 0) & (offset < transformer.sliding_window)
        cache_filled = keys[None, :] >= cached - positions[:, None]  # [B, cached + T]: not before frame 0
        mask = (in_window[None] & cache_filled[:, None, :])[:, None]  # [B, 1, T, cached + T]
        new_states: list[torch.Tensor] = []

        def kv_cache(index: int):
            def extend(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                k = torch.cat([layer_states[2 * index], k], dim=2)
                v = torch.cat([layer_states[2 * index + 1], v], dim=2)
                new_states.extend(_window(t, lengths, cached, dim=2) for t in (k, v))
                return k, v
            return extend

        caches = [kv_cache(index) for index in range(len(transformer.layers))]
        return transformer.run_layers(hidden, cos[:, None], sin[:, None], mask, caches), new_states


def chunk_samples(samples_per_frame: int, trim_samples: int, decoded_frames: int, new_frames: int) -> int:
    """Samples a chunk of ``new_frames`` after ``decoded_frames`` returns: a stream's first chunk lacks the
    one pass's lookahead trim, every later one gives ``samples_per_frame`` per frame (host arithmetic)."""
    return new_frames * samples_per_frame - (trim_samples if decoded_frames == 0 else 0)


class _StatefulConvRunner:
    """``Code2Wav.vocode``'s conv runner for one chunk: prepends each stateful conv's past inputs, records its
    new ones, and keeps each row's count of valid steps (it changes at every transposed conv)."""

    def __init__(self, convs: list[nn.Module], states: list[torch.Tensor], lengths: torch.Tensor,
                 fresh: torch.Tensor):
        self.convs, self.states = convs, states
        self.valid = lengths  # [B]: valid steps of the tensor now flowing through the stack
        self.fresh = fresh  # [B]: the stream's first chunk
        self.new_states: list[torch.Tensor] = []

    def __call__(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(conv, CausalTransConv1d) and conv.trim == 0:  # kernel == stride: no lookahead, no state
            self.valid = self.valid * conv.conv.stride[0]
            return conv(x)
        if isinstance(conv, CausalConv1d) and conv.left_pad == 0:
            return conv(x)
        index = len(self.new_states)
        if index >= len(self.convs) or self.convs[index] is not conv:
            raise RuntimeError("stateful conv called out of state order")
        past = self.states[index]
        padded = torch.cat([past, x], dim=-1)
        self.new_states.append(_window(padded, self.valid, past.shape[-1], dim=-1))
        if isinstance(conv, CausalConv1d):
            return conv.conv_padded(padded)
        return self._transposed(conv, padded)

    def _transposed(self, conv: CausalTransConv1d, padded: torch.Tensor) -> torch.Tensor:
        """Kernel 2r, stride r over [last input, x]: raw output block j (r samples from r * j) pairs inputs
        j - 1 and j of ``padded``. Block 1 pairs the last input with x[0]: this chunk's first new block, except
        in a stream's first chunk, which has no last input and starts at block 2 (as the one pass's trim)."""
        stride = conv.conv.stride[0]
        frames = padded.shape[-1] - 1
        raw = conv.conv(padded)  # [B, C, (frames + 2) * r]
        start = stride + stride * self.fresh.long()
        # clamped: a row with no new frames (a padding row of a CUDA graph's batch bucket) keeps its state as it is
        self.valid = (self.valid * stride - stride * self.fresh.long()).clamp(min=0)
        return _window(raw, start, frames * stride, dim=-1)

    def check_done(self) -> None:
        if len(self.new_states) != len(self.convs):
            raise RuntimeError(f"{len(self.new_states)} of {len(self.convs)} stateful convs ran")


def _window(x: torch.Tensor, start: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Per row b, ``width`` steps of ``x`` along ``dim`` from ``start[b]`` (a gather: rows end at their own
    lengths)."""
    dim = dim % x.dim()
    index = start[:, None] + torch.arange(width, device=x.device)  # [B, width]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = width
    index = index.view(shape).expand(*x.shape[:dim], width, *x.shape[dim + 1:])
    return torch.gather(x, dim, index)
