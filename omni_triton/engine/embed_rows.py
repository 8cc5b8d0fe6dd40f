"""A sequence's input embedding per position ([H] each), kept without a tensor per row until one is read.

The talker pushes one input per row every step, a row of the step's [N, H] inputs each: a view per row (``unbind``)
costs ~1 us of host time, 64 a step at 64 rows, while the rows are read back only by a step that embeds them again
(a prefill after preemption, a row joining a step launched ahead) or by the prefix cache's keys of the prompt. So a
pushed row is kept as (batch, index) and made a view (``batch[index]``: the same storage, offset and strides as the
row ``unbind`` gives) when read.
"""

from __future__ import annotations

import torch


class EmbedRows:
    """List-like (``len``, ``append``, an index or a slice) over [H] rows; ``append_row_of`` keeps a batch's row
    as a reference."""

    def __init__(self, rows=()):
        self._items: list = list(rows)  # a tensor [H], or (batch [N, H], index) for a row not read yet

    @classmethod
    def of_batch(cls, batch: torch.Tensor) -> "EmbedRows":
        """Every row of ``batch`` [N, H], as references (a prompt's prefill: no view made per row)."""
        rows = cls()
        rows._items = [(batch, index) for index in range(batch.shape[0])]
        return rows

    def __len__(self) -> int:
        return len(self._items)

    def append(self, row: torch.Tensor) -> None:
        self._items.append(row)

    def append_row_of(self, batch: torch.Tensor, index: int) -> None:
        """Row ``index`` of ``batch`` [N, H] appended, as a reference (no tensor made for it here)."""
        self._items.append((batch, index))

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self._row(i) for i in range(*key.indices(len(self._items)))]
        return self._row(key)

    def __iter__(self):
        return (self._row(i) for i in range(len(self._items)))

    def tensor(self, start: int, end: int) -> torch.Tensor:
        """Rows start..end-1 as one [end - start, H] tensor: a slice of their batch where they are consecutive rows
        of one (a prompt's prefill), else a stack of the rows."""
        items = self._items[start:end]
        if items and isinstance(items[0], tuple):
            batch, index = items[0]
            if all(isinstance(item, tuple) and item[0] is batch and item[1] == index + k
                   for k, item in enumerate(items)):
                return batch[index:index + len(items)]
        return torch.stack([self._row(i) for i in range(start, end)])

    def _row(self, i: int) -> torch.Tensor:
        item = self._items[i]
        if isinstance(item, tuple):
            batch, index = item
            item = self._items[i] = batch[index]  # read once: the view stays (a later read returns the same one)
        return item
