"""Batch buckets of CUDA graphs (the engines' decode and completion graphs, the vocoder's): a call of ``rows``
rows replays the graph of the smallest bucket that holds it, its rows copied into the graph's static input
and the padding rows zeroed. Pure helpers, shared by ``engine.runner`` and ``models.code2wav_graphs``."""

from __future__ import annotations

import torch


def bucket_for(buckets, rows: int) -> int | None:
    """The smallest of the (ascending) ``buckets`` that holds ``rows``; None for no rows or too many."""
    if rows < 1:
        return None
    return next((b for b in buckets if b >= rows), None)


def fill_padded(static: torch.Tensor, values: torch.Tensor, bucket: int) -> None:
    """A graph's static input: rows 0..n-1 of ``static`` take ``values`` [n, ...], rows n..bucket-1 (padding)
    are zeroed (for token ids: id 0, a valid one), so a replay never depends on the previous call's input."""
    rows = values.shape[0]
    static[:rows].copy_(values)
    static[rows:bucket].zero_()
