"""A decode step's inputs in the host staging buffers the decode CUDA graphs copy from (``runner.DecodeGraphs``),
written for the whole batch with a few numpy operations instead of item writes row by row (from
``VECTOR_ROWS_FROM`` rows; below, the item writes cost less).

Per row: three rope positions, the KV slot, the context length and the token id (one [6, max_batch] int64 buffer),
and the block table (a [rows, width] int32 buffer). A steady decode batch runs the same rows step after step and a
row's block table only grows (by a block every ``block_size`` steps), so the staged tables are kept: a row is
rewritten when its sequence's table is another list than the one staged there (another sequence, or the same one
preempted and admitted again: both assign a new list), else only its new blocks are written. The width grows by
doubling and shrinks once the batch's longest table fits a quarter of it (every row rewritten then); entries past
a row's own table are stale and never read (its context length bounds what attention reads).
"""

from __future__ import annotations

import numpy as np
import torch

from omni_triton.engine.stage import Chunk

POSITIONS, SLOT, CONTEXT_LEN, TOKEN_ID = slice(0, 3), 3, 4, 5  # rows of ``ints``
VECTOR_ROWS_FROM = 16  # rows; a numpy expression (~1 us each here) beats item writes (~1 us a row) from about here


class DecodeRows:
    def __init__(self, max_batch: int, max_blocks: int, block_size: int, pinned: bool):
        self.ints = torch.zeros(6, max_batch, dtype=torch.int64, pin_memory=pinned)
        self.tables = torch.zeros(max_batch * max_blocks, dtype=torch.int32, pin_memory=pinned)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.width = 0  # block table entries staged per row
        self._lists: list[list[int] | None] = [None] * max_batch  # row -> the block table list staged there
        self._lens = [0] * max_batch  # row -> its entries staged
        self._host, self._flat = self.ints.numpy(), self.tables.numpy()
        self._row_starts = np.zeros(max_batch, dtype=np.int64)  # row -> its first entry in the tables (row * width)
        # row -> rope position - sequence position, its prompt's length, whether the prompt's positions are its own
        self._rope_deltas = np.zeros(max_batch, dtype=np.int64)
        self._prompt_lens = np.zeros(max_batch, dtype=np.int64)
        self._explicit = np.zeros(max_batch, dtype=bool)
        self.prompt_rows = False  # whether the last fill had a row at a prompt position

    def fill(self, chunks: list[Chunk], token_ids: list[int] | None = None) -> torch.Tensor:
        """Stage one-position ``chunks`` (and their input ``token_ids``; else 0) in ``ints`` and ``tables``; rows
        past them are padding (slot -1: no KV write; context 0). Returns the staged tables, [rows, width]."""
        n = len(chunks)
        seqs = [seq for seq, _, _ in chunks]
        self._stage_tables(seqs)
        host, bs = self._host, self.block_size
        if n < VECTOR_ROWS_FROM:
            self.prompt_rows = False
            for i, (seq, start, _) in enumerate(chunks):
                host[POSITIONS, i] = start + seq.rope_delta
                if start < seq.num_prompt_positions:
                    self.prompt_rows = True
                    if seq.has_prompt_positions:  # its prompt's own positions (M-RoPE)
                        host[POSITIONS, i] = seq.positions(start, start + 1)[:, 0].numpy()
                host[SLOT, i] = seq.block_table[start // bs] * bs + start % bs
                host[CONTEXT_LEN, i] = start + 1
        else:
            starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
            host[POSITIONS, :n] = starts + self._rope_deltas[:n]
            in_prompt = starts < self._prompt_lens[:n]
            self.prompt_rows = bool(in_prompt.any())
            if self.prompt_rows:
                for i in np.flatnonzero(in_prompt & self._explicit[:n]):  # its prompt's own positions (M-RoPE)
                    host[POSITIONS, i] = seqs[i].positions(int(starts[i]), int(starts[i]) + 1)[:, 0].numpy()
            host[SLOT, :n] = self._flat.take(self._row_starts[:n] + starts // bs) * bs + starts % bs
            host[CONTEXT_LEN, :n] = starts + 1
        host[TOKEN_ID, :n] = 0 if token_ids is None else token_ids
        host[:, n:] = 0
        host[SLOT, n:] = -1
        return self.tables[:n * self.width].view(n, self.width)

    def _stage_tables(self, seqs: list) -> None:
        lists = [seq.block_table for seq in seqs]
        lens = list(map(len, lists))
        need = max(lens)
        if need > self.width or 8 < self.width >= 4 * need:  # another width: every row is staged again
            self.width = min(self.max_blocks, max(8, 1 << (need - 1).bit_length()))
            self._row_starts = np.arange(len(self._lists), dtype=np.int64) * self.width
            self._lists = [None] * len(self._lists)
        width, flat = self.width, self._flat
        # only the rows whose table is another list or grew (a steady batch: a row every ``block_size`` steps),
        # found in one comprehension instead of a loop body per row
        staged_rows = zip(lists, self._lists, lens, self._lens)
        changed = [i for i, (table, staged_table, length, staged) in enumerate(staged_rows)
                   if table is not staged_table or length != staged]
        for i in changed:
            table, length = lists[i], lens[i]
            if self._lists[i] is table:
                staged = self._lens[i]
                flat[i * width + staged:i * width + length] = table[staged:length]
            else:
                flat[i * width:i * width + length] = table
                self._lists[i] = table
                seq = seqs[i]
                self._rope_deltas[i] = seq.rope_delta
                self._prompt_lens[i] = seq.num_prompt_positions
                self._explicit[i] = seq.has_prompt_positions
            self._lens[i] = length
