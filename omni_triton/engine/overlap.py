"""Overlapped decode steps: the next step goes to the GPU before this step's tokens come back to the host.

A synchronous step launches its work, waits for the sampled ids and only then does its host work (appending
tokens, stop checks, outputs) and the next step's (scheduling, input buffers, sampler controls): the GPU idles
for all of that. In the steady decode state of a stage whose next input is a function of the sampled ids on
the device (the thinker: a token's embedding, ``stage.embed_token_ids``; the talker: its frame's codec embeds,
from the completion the decode graph ran, or ``run_ahead`` eagerly, + the next trailing text,
``stage.inputs_ahead``), the next step's
batch is known before the ids are: the same rows, one position further, their inputs on the device. So
``LLMEngine.step`` launches that step first (``launch_next``) and then finishes the previous one, whose
host work runs while the GPU computes.

The step launched ahead runs the rows of this step that go on and have their next input on the device; the
others are left out of it (``left_out``), each known on the host before the ids are: a row that stopped (known
only from its ids, one step late: its overlapped row is computed and dropped, its blocks freed once the launch is
queued, which stream order makes safe) or was aborted, a row whose token this step reaches max_new_tokens (it
finishes with this step, its blocks freed alike), and a talker row whose next trailing text has not arrived (it
waits for input after this step, as after a synchronous one). Their inputs are gathered on the device for the
rows that go; no row's tokens change, as every draw is keyed by the row's own generated-token count (told one
token ahead), never by the batch it runs in. And rows whose input came while they waited (a talker row whose text
arrived) join the step launched ahead, their inputs the sequence's own, their draws and bans without a token
ahead: the scheduler would run them in its next step, one position each. Anything else that changes the batch
waits for the ids as before (the next call is a synchronous step): a request waiting for admission, a row that
must prefill, too few free blocks, and on the host sampler rows whose repetition penalty or min_new_tokens ban
depends on the token not read yet.

A step whose rows all sampled, some of them at the end of their prefill (a prompt in one chunk, or a chunked
prefill's last chunk), is followed ahead like a decode step: every row decodes one token next, at position
``num_computed_tokens`` (the chunk's end), its blocks taken as for any decode row, its draw and bans one token
ahead, its device token history slot given at that first draw. On the thinker its next input is the sampled id's
embedding; the talker completes such a step's sampled rows (the code predictor: not under the decode graph, which
completes a decode step's) when the next step is launched, not when it is finished, one token ahead as the decode
graph does, so their next inputs are on the device.

With ``admit_ahead`` (``EngineConfig.overlap_admit``), rows that only want to join (requests waiting for
admission) and rows whose prefill goes on (a chunk that did not sample) do not stop the launch: the rows that
decode go ahead, and that step's successor is scheduled as a synchronous step would be, with the new rows in it
(their prefill under the scheduler's token budget as usual). They join one step later; no row's tokens change.
Requests queued behind a full running set are no reason at all while none can be admitted (a row finishing with
this step makes room).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.handoff import ready_event, to_device_async
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


# why a step's successor was not launched ahead (the step log's ``not_ahead``): no row of the step sampled (a prefill
# goes on), or one did not (without admit_ahead); every row of it left (stopped, reached its length, waits for input:
# the first of them in LEFT_OUT); the host sampler would read the unread token; requests wait for admission; another
# row became runnable that must prefill; too few free blocks
NOT_AHEAD = ("prefill", "stopped", "length", "sampler", "waiting", "runnable_changed", "inputs", "blocks")
JOINING = ("waiting", "runnable_changed")  # the reasons that only say new rows want to join (admit_ahead)
# why a row of a step is left out of the step launched after it (``left_out``; the step log's), in the order that
# names the reason when every row is
LEFT_OUT = ("stopped", "length", "inputs", "prefill")


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
        self.launched_subsets = 0  # of those, launched with some of the step's rows left out
        self.joined = 0  # rows that joined a step launched ahead (not in the step before it)
        self.joiners: list[Sequence] = []  # the last launch_next's rows joining the step it launched
        self.not_ahead: str | None = None  # why the last launch_next launched nothing (NOT_AHEAD), else None
        self.left_out: dict[str, int] = {}  # the last launch_next's rows left out, by reason (LEFT_OUT)

    @staticmethod
    def supported(runner: ModelRunner) -> bool:
        """The stage's next input is its sampled id's embedding and nothing samples after the main token (the
        thinker), or it is made on the device from the step's completion (the talker: codec embeds + trailing
        text), which the decode graphs run, or ``run_ahead`` eagerly without them."""
        stage = runner.stage
        if getattr(stage, "embed_token_ids", None) is not None:
            return len(runner.streams) == 1
        return (getattr(stage, "inputs_ahead", None) is not None
                and (runner.graphs is None or runner.graphs.in_graph_sampling))

    def host_ids(self, result: StepResult) -> HostIds:
        host = self._host_buffers[self._next_buffer]
        self._next_buffer ^= 1
        return HostIds(result.sampled_token_ids, host)

    def launch_next(self, current: LaunchedStep) -> LaunchedStep | None:
        """The step after ``current`` (not finished yet), launched with its inputs on the device, for current's
        rows that go on and have their next input (the others are left out: ``left_out``); None when the batch
        could change otherwise (the caller then finishes ``current`` and schedules as usual), ``not_ahead``
        saying why."""
        self.left_out = {}
        rows, self.not_ahead = self._rows_ahead(current)
        # rows that want to join are passed over by one launch at most: the step launched despite them is
        # followed by a scheduled one (else an admission could wait behind launch after launch)
        before_joiners = self.admit_ahead and self.not_ahead in JOINING and not current.joiners_next
        if self.not_ahead is not None and not before_joiners:
            return None
        if not rows:  # every row leaves (stops, reaches its length, waits for text or a prefill chunk)
            self.not_ahead = min(self.left_out, key=LEFT_OUT.index)
            return None
        self.not_ahead = None
        result = current.result
        if result.completed is None and len(self.runner.streams) > 1:
            # a step with prefill rows (the talker's): its rows' frames are completed now, not at its finish, one
            # token ahead as the decode graph does, so their next inputs are on the device; its outputs wait for them
            result.completed = self.runner.complete_step(result.sampled_seqs, result.sampled_hidden,
                                                         result.sampled_token_ids, tokens_ahead=1)
            current.ready = ready_event(self.runner.device)
        seqs = [result.sampled_seqs[i] for i in rows]
        inputs = self._next_inputs(current, rows, seqs)
        joiners = self.joiners
        if joiners:  # their inputs are the sequences' own (made when their text came)
            positions = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1) for seq in joiners]
            inputs["inputs_embeds"] = torch.cat([inputs["inputs_embeds"], self.runner.stage.embed_inputs(positions)])
            seqs = seqs + joiners
        if not self.block_manager.allocate_next_positions(seqs):
            self.not_ahead = "blocks"
            return None
        chunks = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1) for seq in seqs]
        result = self.runner.run_ahead(chunks, **inputs, joined=len(joiners))
        for seq in seqs:
            seq.num_computed_tokens += 1
        self.launched += 1
        self.joined += len(joiners)
        self.launched_before_joiners += before_joiners
        self.launched_after_prefills += current.batch.num_new_tokens.count(1) != len(current.batch)
        self.launched_subsets += len(seqs) != len(current.batch)
        batch = ScheduledBatch(seqs=seqs, num_new_tokens=[1] * len(seqs))
        return LaunchedStep(batch, result, self.host_ids(result), ready=ready_event(self.runner.device),
                            joiners_next=before_joiners)

    def _next_inputs(self, current: LaunchedStep, rows: list[int], seqs: list[Sequence]) -> dict:
        """``run_ahead``'s inputs for ``seqs``, the rows ``rows`` of current's sampled rows: their sampled ids
        (token-input stages), or the stage's inputs made from their completion; gathered on the device when
        rows are left out."""
        stage, result = self.runner.stage, current.result
        index = None
        if len(rows) != len(result.sampled_seqs):
            index = to_device_async(torch.tensor(rows), result.sampled_token_ids.device)  # (no wait for the GPU)
        if getattr(stage, "embed_token_ids", None) is not None:
            ids = result.sampled_token_ids
            return {"token_ids": ids if index is None else ids[index]}
        completed = result.completed
        if index is not None:
            completed = {name: t[index] for name, t in completed.items()}
        return {"inputs_embeds": stage.inputs_ahead(seqs, completed)}

    def _rows_ahead(self, current: LaunchedStep) -> tuple[list[int], str | None]:
        """The rows of ``current`` (indices into its sampled rows) that the scheduler would run once more, each
        decoding the token ``current`` samples, whatever those tokens are (short of a stop), and None; or why the
        batch could change otherwise (``NOT_AHEAD``). Left out, counted in ``left_out`` by reason: rows that
        stopped or were aborted since, rows that reach max_new_tokens with current's token (both known on the host
        before the ids are: they finish, their blocks freed once the launch is queued), a talker row whose next
        trailing text has not arrived (it waits for input as it would after a synchronous step, and is runnable
        again when its text comes, as then), and (admit_ahead) rows whose prefill goes on (a chunk that did not
        sample: they join on the step after, as a request admitted there would). No row's tokens change: every
        draw is keyed by the row's own token count, not by the batch it runs in."""
        result, seqs = current.result, current.batch.seqs
        sampled = result.sampled_seqs
        self.joiners = []
        if not sampled:
            return [], "prefill"  # a prefill goes on, nothing sampled: the next batch is the scheduler's
        left = self.left_out
        if len(sampled) != len(seqs):  # a prefill chunk that did not sample: its row waits (admit_ahead only)
            if not self.admit_ahead:
                return [], "prefill"
            left["prefill"] = len(seqs) - len(sampled)
        # one pass over the rows (the steady state's every step): aborted or stopped since; another token still
        # allowed after current's (the row's token count then); the next input on the device (the talker's text)
        running = SequenceStatus.RUNNING
        input_ready = getattr(self.runner.stage, "input_ready_ahead", None)
        rows = []
        for i, seq in enumerate(sampled):
            if seq.status is not running:
                reason = "stopped"
            elif len(seq.output_token_ids) + 1 >= seq.params.max_new_tokens:
                reason = "length"
            elif input_ready is not None and not input_ready(seq):
                reason = "inputs"
            else:
                rows.append(i)
                continue
            left[reason] = left.get(reason, 0) + 1
        if not (self.runner.samplers or all(_host_sampling_ahead_exact(sampled[i]) for i in rows)):
            return rows, "sampler"
        # (admit_ahead: requests that cannot be admitted before a row finishes are no reason; rows reaching their
        # length finish with current, which makes room)
        finishing = left.get("length", 0)
        if self.scheduler.waiting and (not self.admit_ahead or self.scheduler.admits_any(finishing=finishing)):
            return rows, "waiting"
        # another row can run now (every row of current but those stopped is running: only more rows can make the
        # count differ): rows that decode next (a talker row whose text came) join the step, others are the
        # scheduler's
        expected = len(seqs) - left.get("stopped", 0)
        if len(self.scheduler.running) != expected and self.scheduler.count(SequenceStatus.RUNNING) != expected:
            self.joiners = self._decode_joiners(current, len(rows))
            if self.joiners is None:
                self.joiners = []
                return rows, "runnable_changed"
        if "prefill" in left:  # like a joiner's (admit_ahead): the successor is scheduled, with the row's next chunk
            return rows, "runnable_changed"
        return rows, None

    def _decode_joiners(self, current: LaunchedStep, num_rows: int) -> list[Sequence] | None:
        """The runnable rows that are not current's, when every one of them decodes one position
        whose input the sequence holds, past its prompt (a talker row whose text came while it waited: its input
        was made then), and they fit the step's token budget; else None. They join the step launched ahead as
        they would the scheduler's next step; their tokens are appended (no token ahead). A stage whose inputs
        are token ids (the thinker) has no such rows (none waits for input)."""
        if getattr(self.runner.stage, "embed_token_ids", None) is not None:
            return None
        running = SequenceStatus.RUNNING
        joiners = [seq for seq in self.scheduler.running if seq.status is running and not current.has_row(seq)]
        for seq in joiners:
            if not (seq.num_pending == 1 and seq.num_computed_tokens >= seq.num_prompt_positions
                    and seq.samples_after(seq.num_inputs)):
                return None
        if num_rows + len(joiners) > self.scheduler.max_num_batched_tokens:
            return None
        return joiners


def _host_sampling_ahead_exact(seq: Sequence) -> bool:
    """The host sampler reads the row's history (repetition penalty) and token count (the min_new_tokens ban
    on stop ids), which miss the token not read yet: exact only where neither depends on it."""
    row = seq.sample_row
    return row.params.repetition_penalty == 1.0 and row.stop_ids_banned == row.stop_ids_banned_after(1)
