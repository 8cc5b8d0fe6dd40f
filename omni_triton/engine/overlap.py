"""Overlapped decode steps: the next step goes to the GPU before this step's tokens come back to the host.

A synchronous step launches its work, waits for the sampled ids and only then does its host work (appending
tokens, stop checks, outputs) and the next step's (scheduling, input buffers, sampler controls): the GPU idles
for all of that. In the steady decode state of a stage whose next input is a function of the sampled ids on
the device (the thinker: a token's embedding, ``stage.embed_token_ids``; the talker: its frame's codec embeds,
from the completion the decode graph ran, + the next trailing text, ``stage.inputs_ahead``), the next step's
batch is known before the ids are: the same rows, one position further, their inputs on the device. So
``LLMEngine.step`` launches that step first (``launch_next``) and then finishes the previous one, whose
host work runs while the GPU computes.

Only what cannot change the batch is overlapped; anything else waits for the ids as before (the next call
is a synchronous step): a request waiting for admission, an abort, a row that stopped (known only from its
ids: its overlapped row is computed and dropped, its blocks freed once the launch is queued, which stream
order makes safe), a row at max_new_tokens, too few free blocks, a talker row whose next trailing text has not
arrived, and on the host sampler rows whose repetition penalty or min_new_tokens ban depends on the token not
read yet. Tokens, states and draws are the synchronous engine's: every sampler draw is keyed by the row's
generated-token count, told one token ahead.

With ``admit_ahead`` (``EngineConfig.overlap_admit``), rows that only want to join (requests waiting for
admission, a talker row whose text arrived) do not stop the launch: the same rows go ahead once more, and that
step's successor is scheduled as a synchronous step would be, with the new rows in it (their prefill under the
scheduler's token budget as usual). They join one step later; no row's tokens change, as no row's draws depend
on the batch it runs in. Requests queued behind a full running set are no reason at all: none is admitted before
a row finishes, and a finish stops the launches anyway. And a step whose rows all sampled, some of them at the end
of their prefill (a prompt in one chunk, or a chunked prefill's last chunk), is followed ahead like a decode step
on a stage whose next inputs are the sampled ids' embeddings (the thinker): every row decodes one token next, at
position ``num_computed_tokens`` (the chunk's end), its blocks taken as for any decode row, its draw and bans one
token ahead, its device token history slot given at that first draw. A step with a chunk that did not sample
(a prefill going on) still waits for the ids, and so does a talker step with prefill rows: its frames are
completed (the code predictor) when the step is finished, so the next inputs are not on the device at launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.handoff import ready_event
from omni_triton.engine.host_copies import HostIds
from omni_triton.engine.runner import ModelRunner, StepResult
from omni_triton.engine.scheduler import ScheduledBatch, Scheduler
from omni_triton.engine.sequence import Sequence, SequenceStatus


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; ``LLMEngine`` finishes it (tokens to the host) later."""
    batch: ScheduledBatch
    result: StepResult
    host_ids: HostIds
    shape: dict | None = None  # the step log's fields (tracing on at its launch)
    ready: torch.cuda.Event | None = None  # after the work that writes its outputs (handoff.py; CUDA only)
    # launched ahead while new rows wanted to join (admit_ahead): its successor is scheduled, with them in it
    joiners_next: bool = False

    def __post_init__(self):
        self.row_ids = frozenset(map(id, self.batch.seqs))  # its rows' id()s

    def has_row(self, seq: Sequence) -> bool:
        return id(seq) in self.row_ids


# why a step's successor was not launched ahead (the step log's ``not_ahead``): a row of the step did not sample
# (a prefill goes on), or computed a prefill chunk (without admit_ahead; the talker's always); a row stopped or was
# aborted; a row reaches max_new_tokens with its next token; the host sampler would read the unread token; requests
# wait for admission; another row became runnable (a talker row whose text arrived); a row's next input is not on
# the device; too few free blocks
NOT_AHEAD = ("prefill", "stopped", "length", "sampler", "waiting", "runnable_changed", "inputs", "blocks")
JOINING = ("waiting", "runnable_changed")  # the reasons that only say new rows want to join (admit_ahead)


class StepOverlap:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, runner: ModelRunner, max_num_seqs: int,
                 admit_ahead: bool = False):
        self.scheduler = scheduler
        self.admit_ahead = admit_ahead
        self.block_manager = block_manager
        self.runner = runner
        cuda = runner.device.type == "cuda"
        self._host_buffers = ([torch.zeros(max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
                              if cuda else [None, None])
        self._next_buffer = 0
        self.launched = 0  # overlapped steps launched (tests, diagnostics)
        self.launched_before_joiners = 0  # of those, launched while new rows wanted to join (admit_ahead)
        self.launched_after_prefills = 0  # of those, after a step in which rows finished their prefill (admit_ahead)
        self.not_ahead: str | None = None  # why the last launch_next launched nothing (NOT_AHEAD), else None

    @staticmethod
    def supported(runner: ModelRunner) -> bool:
        """The stage's next input is its sampled id's embedding and nothing samples after the main token (the
        thinker), or it is made on the device from the step's completion, which the decode graphs run (the
        talker: codec embeds + trailing text)."""
        stage = runner.stage
        if getattr(stage, "embed_token_ids", None) is not None:
            return len(runner.streams) == 1
        return (getattr(stage, "inputs_ahead", None) is not None and runner.graphs is not None
                and runner.graphs.in_graph_sampling)

    def host_ids(self, result: StepResult) -> HostIds:
        host = self._host_buffers[self._next_buffer]
        self._next_buffer ^= 1
        return HostIds(result.sampled_token_ids, host)

    def launch_next(self, current: LaunchedStep) -> LaunchedStep | None:
        """The step after ``current`` (not finished yet), launched with its inputs on the device; None when the
        batch could change (the caller then finishes ``current`` and schedules as usual), ``not_ahead`` saying
        why."""
        seqs = current.batch.seqs
        self.not_ahead = self._why_not_same_batch(current)
        # rows that want to join are passed over by one launch at most: the step launched despite them is
        # followed by a scheduled one (else an admission could wait behind launch after launch)
        before_joiners = self.admit_ahead and self.not_ahead in JOINING and not current.joiners_next
        if self.not_ahead is not None and not before_joiners:
            return None
        self.not_ahead = None
        inputs = self._next_inputs(current)
        if inputs is None:
            self.not_ahead = "inputs"
            return None
        if not self.block_manager.allocate_next_positions(seqs):
            self.not_ahead = "blocks"
            return None
        chunks = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1) for seq in seqs]
        result = self.runner.run_ahead(chunks, **inputs)
        for seq in seqs:
            seq.num_computed_tokens += 1
        self.launched += 1
        self.launched_before_joiners += before_joiners
        self.launched_after_prefills += current.batch.num_new_tokens.count(1) != len(seqs)
        batch = ScheduledBatch(seqs=list(seqs), num_new_tokens=[1] * len(seqs))
        return LaunchedStep(batch, result, self.host_ids(result), ready=ready_event(self.runner.device),
                            joiners_next=before_joiners)

    def _next_inputs(self, current: LaunchedStep) -> dict | None:
        """``run_ahead``'s inputs for the rows after ``current``: its sampled ids (token-input stages), or the
        stage's inputs made from its completion (None: a row waits for input, or nothing completed it on the
        device)."""
        stage, result = self.runner.stage, current.result
        if getattr(stage, "embed_token_ids", None) is not None:
            return {"token_ids": result.sampled_token_ids}
        if result.completed is None:
            return None
        inputs_embeds = stage.inputs_ahead(current.batch.seqs, result.completed)
        return None if inputs_embeds is None else {"inputs_embeds": inputs_embeds}

    def _prefills_end_ahead(self) -> bool:
        """Whether a step whose rows all sampled, some of them at the end of a prefill, may be followed ahead
        (admit_ahead): its rows then decode one token each, as after a decode step, where the next inputs are
        the sampled ids' embeddings. Not the talker's: a step with prefill rows completes its sampled rows (the
        code predictor) when it is finished, not under the graph, so their next inputs are not on the device."""
        return self.admit_ahead and getattr(self.runner.stage, "embed_token_ids", None) is not None

    def _why_not_same_batch(self, current: LaunchedStep) -> str | None:
        """None when the scheduler would run exactly ``current``'s rows once more, each decoding the token
        ``current`` samples, whatever those tokens are (short of a stop); else why not (``NOT_AHEAD``)."""
        result, seqs = current.result, current.batch.seqs
        if not seqs or len(result.sampled_seqs) != len(seqs):
            return "prefill"  # a prefill goes on (a chunk that did not sample): the next batch is the scheduler's
        if current.batch.num_new_tokens.count(1) != len(seqs) and not self._prefills_end_ahead():
            return "prefill"
        # one pass over the rows (the steady state's every step): aborted or stopped since; another token still
        # allowed after current's (the row's token count then)
        running, at_length = SequenceStatus.RUNNING, False
        for seq in seqs:
            if seq.status is not running:
                return "stopped"
            at_length = at_length or len(seq.output_token_ids) + 1 >= seq.params.max_new_tokens
        if at_length:
            return "length"
        if not (self.runner.samplers or all(_host_sampling_ahead_exact(seq) for seq in seqs)):
            return "sampler"
        # (admit_ahead: requests that cannot be admitted before a row finishes, which stops the launches then
        # anyway, are no reason)
        if self.scheduler.waiting and (not self.admit_ahead or self.scheduler.admits_any()):
            return "waiting"
        # another row can run now (every row of current is running: only more rows can make the count differ)
        if len(self.scheduler.running) != len(seqs) and self.scheduler.count(SequenceStatus.RUNNING) != len(seqs):
            return "runnable_changed"
        return None


def _host_sampling_ahead_exact(seq: Sequence) -> bool:
    """The host sampler reads the row's history (repetition penalty) and token count (the min_new_tokens ban
    on stop ids), which miss the token not read yet: exact only where neither depends on it."""
    row = seq.sample_row
    return row.params.repetition_penalty == 1.0 and row.stop_ids_banned == row.stop_ids_banned_after(1)
