"""The scheduler's steady-state shortcut (every running row decoding one token) against its general loop."""

from __future__ import annotations

import random

import pytest

from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.sampling import SamplingParams
from omni_triton.engine.scheduler import Scheduler
from omni_triton.engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4


def build(spec: list[tuple[int, int, str]], free_blocks: int, waiting: int, budget: int) -> Scheduler:
    """Running sequences from (computed positions, pending inputs, status) rows, each holding the blocks its
    computed positions need; ``free_blocks`` more in the pool; ``waiting`` new requests queued."""
    held = sum(-(-computed // BLOCK_SIZE) for computed, _, _ in spec)
    scheduler = Scheduler(BlockManager(held + free_blocks, BLOCK_SIZE), budget, 64)
    params = SamplingParams(max_new_tokens=100)
    for i, (computed, pending, status) in enumerate(spec):
        seq = Sequence(f"r{i}", params, num_prompt_positions=computed + pending)
        scheduler.block_manager.allocate(seq, computed)
        seq.num_computed_tokens = computed
        seq.status = SequenceStatus(status)
        scheduler.running.append(seq)
    for i in range(waiting):
        scheduler.add(Sequence(f"w{i}", params, num_prompt_positions=5))
    return scheduler


def summary(scheduler: Scheduler, batch) -> tuple:
    return ([seq.request_id for seq in batch.seqs], batch.num_new_tokens,
            [seq.request_id for seq in batch.preempted], [list(seq.block_table) for seq in scheduler.running],
            list(scheduler.block_manager.free_blocks), [seq.request_id for seq in scheduler.waiting])


@pytest.mark.parametrize("seed", range(40))
def test_the_shortcut_schedules_what_the_general_loop_does(seed):
    rng = random.Random(seed)
    spec = [(rng.choice([3, 4, 7, 8, 12, 16]), 1 if rng.random() < 0.85 else rng.choice([0, 3]),
             "running" if rng.random() < 0.8 else "waiting_for_input") for _ in range(rng.randint(1, 12))]
    spec = [(c, p, "waiting_for_input" if p == 0 else s) for c, p, s in spec]
    free, waiting, budget = rng.randint(0, 6), rng.choice([0, 0, 1]), rng.choice([3, 64])
    shortcut, general = build(spec, free, waiting, budget), build(spec, free, waiting, budget)
    taken = shortcut._decode_only_batch()
    reference = general._schedule_general()
    if taken is not None:  # it applies: the same batch, blocks and queue as the general loop
        assert summary(shortcut, taken) == summary(general, reference)
        assert not reference.preempted
    else:  # it steps aside without touching anything
        assert summary(shortcut, shortcut._schedule_general()) == summary(general, reference)


def test_the_shortcut_takes_the_steady_state_and_leaves_the_rest():
    decoding = [(4, 1, "running"), (7, 1, "running"), (8, 0, "waiting_for_input")]
    scheduler = build(decoding, free_blocks=1, waiting=0, budget=64)
    batch = scheduler._decode_only_batch()
    assert [seq.request_id for seq in batch.seqs] == ["r0", "r1"] and batch.num_new_tokens == [1, 1]
    assert len(scheduler.running[0].block_table) == 2  # position 4 needed a second block of 4
    assert build(decoding, free_blocks=0, waiting=0, budget=64)._decode_only_batch() is None  # short of blocks
    assert build(decoding, free_blocks=1, waiting=1, budget=64)._decode_only_batch() is None  # admission due
    assert build(decoding, free_blocks=1, waiting=0, budget=1)._decode_only_batch() is None  # over the budget
    assert build(decoding + [(3, 3, "running")], 4, 0, 64)._decode_only_batch() is None  # a prefill chunk


def test_allocating_the_next_positions_takes_blocks_for_all_rows_or_none():
    # rows with 4, 6 and 8 computed positions: the first and last have full tables, the middle has room
    scheduler = build([(4, 1, "running"), (6, 1, "running"), (8, 1, "running")], free_blocks=1, waiting=0, budget=64)
    bm, seqs = scheduler.block_manager, list(scheduler.running)
    tables = [list(seq.block_table) for seq in seqs]
    assert not bm.allocate_next_positions(seqs)  # two full tables, one free block: nothing taken
    assert [seq.block_table for seq in seqs] == tables and bm.num_free == 1
    assert bm.allocate_next_positions(seqs[1:2]) and seqs[1].block_table == tables[1]  # room: no block
    assert bm.allocate_next_positions(seqs[:2]) and bm.num_free == 0
    assert len(seqs[0].block_table) == len(tables[0]) + 1
