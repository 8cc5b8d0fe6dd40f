"""Who runs this step: decode rows first, then prefill chunks, then FCFS admission, under a token budget.

When a running sequence needs a block and none is free, the newest running sequence is preempted by
recompute (blocks freed, computed prefix forgotten, re-queued at the front of the waiting queue). With prefix
caching, admission starts a sequence after the longest cached run of blocks its inputs begin with
(``BlockManager.cached_prefix``): those positions cost neither budget nor new blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} and max_num_seqs={max_num_seqs} "
                             "must be >= 1")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # holds blocks (RUNNING or WAITING_FOR_INPUT), oldest first
        self.num_preemptions = 0

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is; frees all its blocks at once."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status != SequenceStatus.FINISHED:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def refresh_status(self, seq: Sequence) -> None:
        """RUNNING <-> WAITING_FOR_INPUT, depending on whether seq has inputs left to compute."""
        if seq.status == SequenceStatus.RUNNING and seq.num_pending == 0:
            seq.status = SequenceStatus.WAITING_FOR_INPUT
        elif seq.status == SequenceStatus.WAITING_FOR_INPUT and seq.num_pending > 0:
            seq.status = SequenceStatus.RUNNING

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.status == SequenceStatus.RUNNING for s in self.running)

    def admits_any(self, finishing: int = 0) -> bool:
        """Whether a request waits for admission and the running set has room for it (blocks and the token
        budget aside) once ``finishing`` running sequences left: when full, nothing is admitted before a running
        sequence finishes."""
        return bool(self.waiting) and len(self.running) - finishing < self.max_num_seqs

    def count(self, status: SequenceStatus) -> int:
        if status == SequenceStatus.WAITING:
            return len(self.waiting)
        return sum(s.status == status for s in self.running)

    # -- the step -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        decoding = self._decode_only_batch()
        return decoding if decoding is not None else self._schedule_general()

    def _schedule_general(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # each running sequence is seen once per phase, and one scheduled in the decode phase (one pending
        # position) is not a prefill-phase row, nor is a preempted one RUNNING: no membership test is needed
        for decode_phase in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status != SequenceStatus.RUNNING or (seq.num_pending == 1) != decode_phase:
                    continue
                budget -= self._schedule_running(seq, budget, batch)
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _decode_only_batch(self) -> ScheduledBatch | None:
        """The steady state's batch without the general loop: nothing waiting for admission, every running
        sequence that has input decoding one token, blocks enough for all of them. The same batch as the
        general loop's (running order, no preemption), in a few attribute reads a row; None otherwise."""
        if self.waiting:
            return None
        seqs = []
        for seq in self.running:
            if seq.status != SequenceStatus.RUNNING:
                continue  # waiting for input (a talker row): the general loop skips it too
            if seq.num_inputs - seq.num_computed_tokens != 1:
                return None  # a prefill chunk: the general loop's second phase
            seqs.append(seq)
        if (not seqs or len(seqs) > self.max_num_batched_tokens
                or not self.block_manager.allocate_next_positions(seqs)):
            return None
        return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * len(seqs))

    def _schedule_running(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        while True:
            n = min(seq.num_pending, budget, self._tokens_that_fit(seq))
            if n > 0:
                self.block_manager.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                return n
            victim = next(s for s in reversed(self.running) if s not in batch.seqs)
            self._preempt(victim, batch)
            if victim is seq:
                return 0

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.cached_prefix(seq)  # prefix caching: computed by earlier requests
            cached_tokens = len(cached) * self.block_manager.block_size
            fit = (len(cached) + self.block_manager.num_free_after_taking(cached)) * self.block_manager.block_size
            n = min(seq.num_pending - cached_tokens, budget, fit - cached_tokens)
            if n <= 0:
                break  # FCFS: later requests do not overtake the head of the queue
            self.waiting.popleft()
            self.block_manager.take_cached(seq, cached)
            self.block_manager.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _tokens_that_fit(self, seq: Sequence) -> int:
        bm = self.block_manager
        return (len(seq.block_table) + bm.num_free) * bm.block_size - seq.num_computed_tokens

    def _insert_running(self, seq: Sequence) -> None:
        index = len(self.running)
        while index > 0 and self.running[index - 1].arrival > seq.arrival:
            index -= 1
        self.running.insert(index, seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1
