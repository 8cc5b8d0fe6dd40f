"""engine/decode_inputs.DecodeRows: the decode graphs' staged inputs equal the direct per-row computation
(``Sequence.positions``, ``kv_slots``, the block table) step after step, as rows come and go, tables grow,
a sequence gets a new table (preempted, admitted again), explicit M-RoPE prompt positions are decoded, and the
batch crosses the numpy path's row count both ways."""

from __future__ import annotations

import random

import numpy as np
import torch

from omni_triton.engine.block_manager import kv_slots
from omni_triton.engine.decode_inputs import VECTOR_ROWS_FROM, DecodeRows
from omni_triton.engine.sampling import SamplingParams
from omni_triton.engine.sequence import Sequence

BLOCK_SIZE, MAX_BATCH, MAX_BLOCKS = 4, 40, 400


def check(rows: DecodeRows, chunks, token_ids=None):
    tables = rows.fill(chunks, token_ids).numpy()
    ints = rows.ints.numpy()
    n = len(chunks)
    for i, (seq, start, end) in enumerate(chunks):
        assert ints[:3, i].tolist() == seq.positions(start, end)[:, 0].tolist()
        assert ints[3, i] == kv_slots(seq.block_table, start, end, BLOCK_SIZE)[0]
        assert ints[4, i] == end
        assert ints[5, i] == (0 if token_ids is None else token_ids[i])
        assert tables[i, :len(seq.block_table)].tolist() == seq.block_table
    assert (ints[:3, n:] == 0).all() and (ints[3, n:] == -1).all() and (ints[4:, n:] == 0).all()
    assert rows.prompt_rows == any(start < seq.num_prompt_positions for seq, start, _ in chunks)


def test_staged_rows_follow_the_batch_step_after_step():
    rng = random.Random(0)
    free = list(range(MAX_BLOCKS))
    rng.shuffle(free)

    def new_sequence(index: int) -> Sequence:
        prompt = rng.randrange(1, 30)
        explicit = torch.randint(0, 50, (3, prompt)) if index % 3 == 0 else None  # M-RoPE prompt positions
        seq = Sequence(f"r{index}", SamplingParams(), num_prompt_positions=prompt, prompt_positions=explicit)
        seq.num_computed_tokens = rng.randrange(0, prompt)  # decodes from inside its prompt, some of them
        return seq

    def grow(seq: Sequence) -> None:
        while len(seq.block_table) * BLOCK_SIZE <= seq.num_computed_tokens:
            seq.block_table.append(free.pop())

    rows = DecodeRows(MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, pinned=False)
    batch = [new_sequence(i) for i in range(3)]
    made = len(batch)
    for step in range(120):
        target = VECTOR_ROWS_FROM + 8 if step % 60 < 30 else 3  # past the numpy path's row count and back
        if len(batch) < target:
            batch.append(new_sequence(made))
            made += 1
        elif len(batch) > target or rng.random() < 0.1:
            free.extend(batch.pop(rng.randrange(len(batch))).block_table)  # a row finished
        if rng.random() < 0.1:  # preempted and admitted again: a new table list
            seq = rng.choice(batch)
            free.extend(seq.block_table)
            seq.block_table = []
        for seq in batch:
            grow(seq)
        chunks = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1) for seq in batch]
        check(rows, chunks, [rng.randrange(100) for _ in batch] if step % 2 else None)
        for seq in batch:
            seq.num_computed_tokens += 1


def test_the_width_shrinks_once_long_tables_left():
    rows = DecodeRows(4, 200, BLOCK_SIZE, pinned=False)
    long = Sequence("long", SamplingParams(), num_prompt_positions=1)
    long.block_table, long.num_computed_tokens = list(range(100)), 399
    short = Sequence("short", SamplingParams(), num_prompt_positions=1)
    short.block_table, short.num_computed_tokens = [150, 151], 5
    check(rows, [(long, 399, 400), (short, 5, 6)])
    assert rows.width == 128
    check(rows, [(short, 5, 6)])
    assert rows.width == 8
    assert np.array_equal(rows.fill([(short, 5, 6)]).numpy()[0, :2], [150, 151])
