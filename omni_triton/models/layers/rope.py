"""Rotary position embeddings: plain 1-D RoPE and Qwen3-Omni's interleaved M-RoPE.

Interleaved M-RoPE: positions come as 3 rows (t, h, w). Frequency ``i`` (of head_dim/2) takes its angle
from row h when ``i % 3 == 1 and i < 3 * section[1]``, from row w when ``i % 3 == 2 and i < 3 * section[2]``,
and from row t otherwise; the half is then duplicated (rotate-half layout). For text and audio all three
rows are equal, so it reduces to 1-D RoPE.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Holds no parameters or buffers: its tables are derived from the config on the CPU (so a model built
    on the meta device and materialised by the loader needs nothing re-initialised) and moved to the
    positions' device once."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None = None):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self.mrope_section = mrope_section
        # row (0=t, 1=h, 2=w) whose position drives each frequency
        self.freq_row = torch.zeros(head_dim // 2, dtype=torch.long, device="cpu")
        if mrope_section is not None:
            for axis in (1, 2):
                self.freq_row[axis:mrope_section[axis] * 3:3] = axis

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != device:
            self.inv_freq, self.freq_row = self.inv_freq.to(device), self.freq_row.to(device)
        return self.inv_freq, self.freq_row

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] or [3, T] -> cos, sin [T, head_dim] in ``dtype`` (angles computed in fp32)."""
        inv_freq, row = self._tables_on(positions.device)
        if self.mrope_section is None:
            if positions.dim() == 2:
                positions = positions[0]
            freqs = positions[:, None].float() * inv_freq  # [T, D/2]
        else:
            if positions.dim() == 1:
                positions = positions[None].expand(3, -1)
            per_row = positions[..., None].float() * inv_freq  # [3, T, D/2]
            freqs = per_row.gather(0, row[None, None, :].expand(1, per_row.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] (rotate-half layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
