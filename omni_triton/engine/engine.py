"""LLMEngine: add / append / abort / step over one stage model (single-threaded, deterministic), and
EngineLoop: the same behind a background step thread plus a response thread, for serving."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from omni_triton import trace
from omni_triton.engine.block_manager import BlockManager, num_blocks_for_budget
from omni_triton.engine.handoff import OutputStream, ready_event, to_device_async
from omni_triton.engine.host_copies import HostIds
from omni_triton.engine.kept_states import KeptStates
from omni_triton.engine.output_batching import HeldOutputs, OutputBatching
from omni_triton.engine.overlap import LaunchedStep, StepOverlap
from omni_triton.engine.prefix_cache import with_positions
from omni_triton.engine.runner import ModelRunner
from omni_triton.engine.sampling import SamplingParams
from omni_triton.engine.scheduler import Scheduler
from omni_triton.engine.sequence import Sequence, SequenceStatus
from omni_triton.engine.stage import StageModel
from omni_triton.engine.step_log import UNTIMED, BetweenSteps, StepLog, Untimed

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # or derived from kv_budget_bytes
    kv_budget_bytes: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    device: str = "cpu"
    kv_dtype: torch.dtype = torch.float32
    # CUDA only: Triton kernels, GPU sampling and (cuda_graphs) CUDA-graph decode; off = the plain torch path
    fast_path: bool = True
    cuda_graphs: bool = True
    # with cuda_graphs and the fused steps: steps with prefill rows of up to this many tokens replay a graph too
    # (None: the step budget, max_num_batched_tokens; 0: they run eagerly)
    prefill_graph_tokens: int | None = None
    # fast path: how the code predictor's small linears launch and, under "gemv", whether the decode step's layer
    # linears are GEMVs (fast_kernels.LINEAR_LAUNCHES, step_linear)
    linear_launch: str = "gemv"
    # fast path on sm_90+: kernels launched with programmatic dependent launch (kernels.dependent_launch; the
    # switch is process-wide: the last engine made in a process sets it)
    dependent_launch: bool = True
    # warm start: the stage services run engine.warmup (every kernel shape serving will use) before serving
    warmup: bool = False
    # launch the next decode step before this one's tokens reach the host where the stage's next input can be
    # made on the device (the thinker; the talker: overlap.py), for the rows that go on (rows that finish or wait
    # for input stay out, rows whose input came join); the same tokens either way
    overlap_steps: bool = True
    # with overlapped steps: also while requests are queued for admission or a row's prefill goes on (a chunk that
    # samples nothing), the decoding rows are launched ahead once and the new rows (the next chunk) join on the step
    # after (overlap.py); the same tokens either way. Default: $OMNI_TRITON_OVERLAP_ADMIT=1 turns it on (off: they
    # join on a synchronous step)
    overlap_admit: bool = field(default_factory=lambda: os.environ.get("OMNI_TRITON_OVERLAP_ADMIT", "0") == "1")
    # computed KV blocks named by their content and reused by later requests whose inputs begin the same way
    # (block_manager, prefix_cache); the streamed states of cached positions are kept or recomputed (kept_states)
    prefix_caching: bool = False
    # EngineLoop: when a request's outputs go to its callback (every step, or a few at a time: output_batching.py)
    output_batching: OutputBatching = field(default_factory=OutputBatching)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error: ..."
    # Per computed position, streamed once each (thinker: "input_embeds", "accept_hidden" [n, H])
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    states_start: int = 0  # position of the first row of ``states`` in the sequence (prompt position 0 = 0)
    # Per sampled token, from the stage's post-step hook (talker: "codes" [1, G])
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # ``new_token_ids`` where the step sampled them (on a GPU: no host -> device copy to embed them again)
    token_ids_device: torch.Tensor | None = None
    # CUDA: events after which the device tensors above are complete (handoff.py); none on the CPU
    ready_events: tuple = ()

    def device_tensors(self) -> list[torch.Tensor]:
        tensors = [*self.states.values(), *self.extras.values()]
        return tensors if self.token_ids_device is None else [*tensors, self.token_ids_device]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_input: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int
    # prefix caching: inputs of admitted requests (per admission: a recompute's again), those taken from the
    # cache, blocks named in the cache now, and named blocks evicted for new ones
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_blocks: int = 0
    prefix_evictions: int = 0


class LLMEngine:
    def __init__(self, stage: StageModel, config: EngineConfig | None = None):
        config = config or EngineConfig()
        num_blocks = config.num_blocks
        if num_blocks is None:
            if config.kv_budget_bytes is None:
                raise ValueError("EngineConfig needs num_blocks or kv_budget_bytes")
            num_blocks = num_blocks_for_budget(config.kv_budget_bytes, config.block_size, stage.num_layers,
                                               stage.num_kv_heads, stage.head_dim, config.kv_dtype)
        self.config = config
        self.stage = stage
        kept = stage.kept_states if config.prefix_caching else {}
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching,
                                          blocks_keep_states=bool(kept))
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(stage, num_blocks, config.block_size, device=config.device,
                                  kv_dtype=config.kv_dtype, fast_path=config.fast_path,
                                  max_num_seqs=config.max_num_seqs, cuda_graphs=config.cuda_graphs,
                                  prefill_graph_tokens=(config.max_num_batched_tokens
                                                        if config.prefill_graph_tokens is None
                                                        else config.prefill_graph_tokens),
                                  linear_launch=config.linear_launch, dependent_launch=config.dependent_launch)
        self.kept_states = (KeptStates(kept, num_blocks, config.block_size, self.runner.model_dtype, self.runner.device)
                            if kept else None)
        self.requests: dict[str, Sequence] = {}
        self.name = type(stage).__name__.removesuffix("Stage").lower()  # "thinker", "talker": trace event names
        self.last_step_size = 0  # sequences scheduled by the last step (0: nothing could run)
        self.step_log = StepLog(self.name, self.runner.device)  # written while tracing is on
        self.overlap = (StepOverlap(self.scheduler, self.block_manager, self.runner, config.max_num_seqs,
                                    admit_ahead=config.overlap_admit)
                        if config.overlap_steps and StepOverlap.supported(self.runner) else None)
        self._inflight: LaunchedStep | None = None  # launched by the last step, finished by the next (overlap)
        # what the outputs carry: the states of positions past the prompt, the sampled ids on the device
        self._states_past_prompt = getattr(stage, "states_past_prompt", True)
        self._device_token_ids = getattr(stage, "device_token_ids", True)
        # the step log's not_ahead when no step is ever launched ahead
        self._no_overlap = None if self.overlap is not None else "off" if not config.overlap_steps else "not_supported"

    # -- client API -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, sampling_params: SamplingParams, *,
                    prompt_token_ids: list[int] | None = None, prompt_embeds: torch.Tensor | None = None,
                    prompt_positions: torch.Tensor | None = None, **stage_inputs) -> None:
        """Thinker: ``prompt_token_ids`` (+ ``audio_embeds``). Talker: ``prompt_embeds`` [P, H]
        (+ ``trailing_text_embeds``, ``thinker_finished``). ``prompt_positions`` [3, P] for M-RoPE prompts."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if prompt_token_ids is None and prompt_embeds is None:
            raise ValueError(f"request {request_id!r}: give prompt_token_ids or prompt_embeds")
        num_positions = len(prompt_token_ids) if prompt_token_ids is not None else prompt_embeds.shape[0]
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if num_positions + sampling_params.max_new_tokens > capacity:
            raise ValueError(f"request {request_id!r}: {num_positions} prompt positions + max_new_tokens "
                             f"{sampling_params.max_new_tokens} exceed the KV cache ({capacity} tokens)")
        seq = Sequence(request_id, sampling_params, num_prompt_positions=num_positions,
                       prompt_token_ids=prompt_token_ids, prompt_positions=prompt_positions,
                       device=self.runner.device)
        if prompt_embeds is not None:
            stage_inputs["prompt_embeds"] = prompt_embeds
        self.stage.init_sequence(seq, **stage_inputs)
        if self.block_manager.prefix_caching:
            keys = self.stage.cache_keys(seq)
            if prompt_positions is not None:  # (the sequence's host copy of them)
                keys = with_positions(keys, seq.positions(0, num_positions))
            seq.cache_keys = keys.tobytes()
            seq.keys_follow_tokens = getattr(self.stage, "embed_token_ids", None) is not None
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        trace.event(request_id, f"{self.name}.added")

    def append(self, request_id: str, **inputs) -> None:
        """More input for a running request (talker: ``trailing_text_embeds`` [n, H], ``finished``)."""
        seq = self.requests.get(request_id)
        if seq is None:
            raise KeyError(f"append: unknown or finished request_id {request_id!r}")
        self.stage.append_input(seq, **inputs)
        if not self._in_flight(seq):  # else the finish of its step refreshes it (see _finish)
            self.scheduler.refresh_status(seq)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Frees all of the request's blocks now. Returns its final output, or None if it is not known."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        return RequestOutput(request_id, finished=True, finish_reason=reason)

    def abort_all(self, reason: str) -> list[RequestOutput]:
        return [self.abort(request_id, reason) for request_id in list(self.requests)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        s = self.scheduler
        bm = self.block_manager
        return EngineStats(s.count(SequenceStatus.RUNNING), s.count(SequenceStatus.WAITING),
                           s.count(SequenceStatus.WAITING_FOR_INPUT), bm.num_used, bm.num_free, s.num_preemptions,
                           bm.num_query_tokens, bm.num_hit_tokens, bm.num_cached, bm.num_evictions)

    # -- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one step and returns its outputs. Overlapped (``overlap.py``): finishes the step launched by the
        last call, after launching the one after it."""
        began = self.step_log.begin() if trace.enabled() else None
        current, self._inflight = self._inflight, None
        ahead = current is not None  # launched by the last call's launch_next
        if current is None:
            current = self._launch_scheduled(traced=began is not None)
            if current is None:
                return []
        self.last_step_size = len(current.batch)
        not_ahead, left_out, joined = self._no_overlap, None, 0
        if self.overlap is not None:
            self._inflight = self.overlap.launch_next(current)
            not_ahead = self.overlap.not_ahead
            if self._inflight is not None:
                left_out, joined = self.overlap.left_out or None, len(self.overlap.joiners)
            if self._inflight is not None and began is not None:
                self._inflight.shape = self._step_shape(self._inflight.batch, decoding=True)
        outputs, completion_rows = self._finish(current)
        if self._inflight is not None and all(seq.is_finished for seq in self._inflight.batch.seqs):
            self._inflight, not_ahead, left_out, joined = None, "stopped", None, 0  # every row stopped: none to deliver
        if began is not None and current.shape is not None:  # (tracing turned on since its launch: no shape)
            result = current.result
            completes = len(self.runner.streams) > 1  # the stage's completion samples (talker: code predictor)
            self.step_log.end(began, **current.shape, ahead=ahead, not_ahead=not_ahead, left_out=left_out,
                              joined=joined, sampled=len(result.sampled_seqs),
                              completion_rows=completion_rows if completes else 0,
                              left_runnable=self.scheduler.count(SequenceStatus.RUNNING) + len(self.scheduler.waiting),
                              left_waiting_input=self.scheduler.count(SequenceStatus.WAITING_FOR_INPUT))
        return [out for out in outputs.values()
                if out.new_token_ids or out.states or out.extras or out.finished]

    def _launch_scheduled(self, traced: bool) -> LaunchedStep | None:
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.runner.release(seq)
        self.last_step_size = len(batch)
        if not batch:
            return None
        shape = None
        if traced:
            for seq in batch.seqs:
                if seq.num_computed_tokens == seq.num_cached_tokens:
                    trace.event(seq.request_id, f"{self.name}.prefill_start")
            shape = self._step_shape(batch)
        result = self.runner.run(batch)
        for seq, _, end in result.chunks:
            seq.num_computed_tokens = end
        ready = ready_event(self.runner.device)  # the step's outputs are written: what its responses wait for
        host_ids = self.overlap.host_ids(result) if self.overlap is not None else HostIds(result.sampled_token_ids)
        return LaunchedStep(batch, result, host_ids, shape, ready)

    def _finish(self, step: LaunchedStep) -> tuple[dict[str, RequestOutput], int]:
        """The launched step's host work: states and tokens out, stop checks, the stage's bookkeeping. Rows
        finished or aborted since its launch (an overlapped step's) are dropped. Returns the outputs and the
        number of rows that go on."""
        result = step.result
        ready = step.ready
        finished = SequenceStatus.FINISHED
        outputs = {seq.request_id: RequestOutput(seq.request_id)
                   for seq in step.batch.seqs if seq.status is not finished}
        if result.captured:
            ready = self._stream_states(result, outputs, ready)

        continuing, continuing_outputs = [], []
        if result.sampled_seqs:
            token_ids = step.host_ids.tolist()  # the step's one device -> host copy
            # each row's id where the step sampled it, for a stage whose consumer embeds it again (views in one call)
            ids_device = result.sampled_token_ids.split(1) if self._device_token_ids else None
            for i, (seq, token_id) in enumerate(zip(result.sampled_seqs, token_ids)):
                if seq.status is finished:
                    continue
                reason = seq.append_token(token_id)
                if len(seq.output_token_ids) == 1:
                    trace.event(seq.request_id, f"{self.name}.first_token")
                output = outputs[seq.request_id]
                output.new_token_ids.append(token_id)
                if ids_device is not None:
                    output.token_ids_device = ids_device[i]
                if reason is None:
                    continuing.append(i)
                    continuing_outputs.append(output)
                else:
                    self._finish_request(seq, reason, output)
            if continuing:
                seqs = result.sampled_seqs
                hidden, ids, completed = result.sampled_hidden, result.sampled_token_ids, result.completed
                gathered = len(continuing) < len(ids)
                if gathered:  # rows that finished drop out (else: no copy, no gathers)
                    seqs = [seqs[i] for i in continuing]
                    # (a pageable copy would wait for the step launched after this one: rows reaching their length)
                    index = to_device_async(torch.tensor(continuing), hidden.device)
                    hidden, ids = hidden[index], ids[index]
                    completed = None if completed is None else {name: t[index] for name, t in completed.items()}
                completes_here = completed is None
                if completes_here:
                    completed = self.runner.complete_step(seqs, hidden, ids)
                # else: a CUDA graph completed every sampled row
                extras = self.stage.after_sample(seqs, completed)
                for output, extra in zip(continuing_outputs, extras):
                    if extra:
                        output.extras = extra
                if gathered or completes_here:
                    # the extras were made here, behind the step launched after this one when there is one (rare:
                    # a row stopped, or a step without a completion graph, which launches nothing ahead)
                    ready = ready_event(self.runner.device)
        if ready is not None:
            for output in outputs.values():
                output.ready_events = (ready,)

        # a row of the step launched after this one already holds its next position: its status is the next
        # finish's to refresh (now it would read no input pending)
        in_flight = self._inflight.row_ids if self._inflight is not None else frozenset()
        naming = self.block_manager.prefix_caching
        if not naming and step.row_ids <= in_flight:  # (a steady overlapped step: every row goes on ahead)
            return outputs, len(continuing)
        for seq in step.batch.seqs:
            if seq.status is not finished:
                if naming:
                    self.block_manager.name_computed_blocks(seq)  # its computed blocks, named
                if id(seq) not in in_flight:
                    self.scheduler.refresh_status(seq)
        return outputs, len(continuing)

    def _stream_states(self, result, outputs: dict[str, RequestOutput], ready):
        """The step's captured per-position states into its rows' outputs (each position streamed once; with
        ``stage.states_past_prompt`` off, prompt positions only) and, with prefix caching, kept beside their
        blocks. Returns the event the outputs are complete after (later when cached positions' states were
        made here)."""
        past_prompt = self._states_past_prompt
        for (seq, start, end), offset in zip(result.chunks, result.row_offsets):
            if seq.is_finished:
                continue
            if self.kept_states is not None and start < seq.num_prompt_positions:
                self._keep_states(seq, start, min(end, seq.num_prompt_positions), result.captured, offset)
            emitted = seq.num_emitted_positions
            stop = end if past_prompt else min(end, seq.num_prompt_positions)
            if emitted < stop:
                rows = slice(offset + max(start, emitted) - start, offset + stop - start)
                states = {name: t[rows] for name, t in result.captured.items()}
                if emitted < start:  # positions taken from the prefix cache: their states first, made here
                    states = _concat_rows(self._cached_states(seq, emitted, start), states)
                    ready = ready_event(self.runner.device)  # (after the launch's event: the responses wait for it)
                outputs[seq.request_id].states = states
                outputs[seq.request_id].states_start = emitted
                seq.num_emitted_positions = stop
        return ready

    def _keep_states(self, seq: Sequence, start: int, end: int, captured: dict[str, torch.Tensor],
                     offset: int) -> None:
        """Prompt positions start..end-1 computed this step: their kept states beside their KV (prefix caching)."""
        rows = slice(offset, offset + end - start)
        self.kept_states.store(seq, start, {name: captured[name][rows] for name in self.kept_states.pools})
        if start <= seq.states_through:
            seq.states_through = max(seq.states_through, end)

    def _cached_states(self, seq: Sequence, start: int, end: int) -> dict[str, torch.Tensor]:
        """The streamed states of positions start..end-1, taken from the prefix cache: kept ones and recomputed."""
        states = self.stage.recompute_states(seq, start, end)
        if self.kept_states is not None:
            states.update(self.kept_states.load(seq, start, end))
        return states

    def _in_flight(self, seq: Sequence) -> bool:
        """Whether an overlapped step launched for seq is not finished yet."""
        return self._inflight is not None and self._inflight.has_row(seq)

    def _step_shape(self, batch, decoding: bool = False) -> dict:
        """The step log's fields known before the step runs (``step_log.py``); ``decoding``: every row decodes
        (an overlapped step, launched before its inputs are appended)."""
        decode_rows = len(batch) if decoding else sum(n == 1 and seq.samples_after(seq.num_computed_tokens + 1)
                                                      for seq, n in zip(batch.seqs, batch.num_new_tokens))
        kind = "decode" if decode_rows == len(batch) else "prefill" if decode_rows == 0 else "mixed"
        graphs, prefill_graphs = self.runner.graphs, self.runner.prefill_graphs
        tokens = sum(batch.num_new_tokens)
        replays = (graphs is not None and graphs.serves_rows(len(batch)) if kind == "decode"
                   else prefill_graphs is not None and prefill_graphs.serves_step(len(batch), tokens))
        return dict(kind=kind, rows=len(batch), tokens=tokens, prefill_tokens=tokens - decode_rows,
                    decode_rows=decode_rows, graph=replays,
                    preempted=len(batch.preempted), waiting=len(self.scheduler.waiting),
                    waiting_input=self.scheduler.count(SequenceStatus.WAITING_FOR_INPUT))

    def _finish_request(self, seq: Sequence, reason: str, output: RequestOutput) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        del self.requests[seq.request_id]
        output.finished = True
        output.finish_reason = reason


OutputCallback = Callable[[RequestOutput], None]


class RequestStream:
    """A per-request output queue for consumers that prefer iterating to callbacks."""

    def __init__(self):
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput:
        return self._queue.get(timeout=timeout)

    def __iter__(self):
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return


class EngineLoop:
    """Runs ``engine.step()`` on a background thread; add / append / abort are thread-safe commands applied
    between steps. Outputs go through an unbounded queue to a separate response thread that calls each
    request's callback, so a slow consumer (Triton response sender) never stalls the step loop."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._callbacks_lock = threading.Lock()
        self._stop = threading.Event()
        self._stats = engine.stats()
        self._step_thread = threading.Thread(target=self._step_loop, name="engine-step", daemon=True)
        self._response_thread = threading.Thread(target=self._response_loop, name="engine-response", daemon=True)
        self._output_stream = OutputStream(engine.runner.device)
        self._held = HeldOutputs(engine.config.output_batching)
        self._first_tokens_sent: set[str] = set()  # (while tracing) requests whose first tokens went out

    def start(self) -> "EngineLoop":
        self._step_thread.start()
        self._response_thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Aborts what is left, then stops both threads (after the response thread drained)."""
        self._commands.put(("shutdown",))
        self._step_thread.join(timeout)
        self._responses.put(None)
        self._response_thread.join(timeout)

    # -- thread-safe client API -----------------------------------------------------------------------------
    def add_request(self, request_id: str, sampling_params: SamplingParams, callback: OutputCallback | None = None,
                    **request_inputs) -> RequestStream | None:
        """Queue a request; outputs go to ``callback`` (on the response thread) or to the returned stream.
        Invalid requests get one final output with ``finish_reason`` "error: ..."."""
        stream = None
        if callback is None:
            stream = RequestStream()
            callback = stream.put
        with self._callbacks_lock:
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._callbacks[request_id] = callback
        self._commands.put(("add", request_id, sampling_params, request_inputs))
        return stream

    def append(self, request_id: str, **inputs) -> None:
        self._commands.put(("append", request_id, inputs))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats  # snapshot taken by the step thread after each step

    # -- threads --------------------------------------------------------------------------------------------
    def _step_loop(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # CUDA's current device is per thread: kernels and syncs here are the stage's
            torch.cuda.set_device(device)
        while not self._stop.is_set():
            # while tracing, what the loop does between steps is timed into the step log (step_log.BetweenSteps)
            gap = self.engine.step_log.between if trace.enabled() else UNTIMED
            # block for commands when idle, or when everything runnable is stuck behind blocks held by
            # requests waiting for input (only an append or abort can change that)
            idle = not self.engine.has_work() or self.engine.last_step_size == 0
            if idle:  # nothing queued behind the last steps' GPU events
                gap.time("blocked", self.engine.step_log.flush, True)
            self._apply_commands(block=idle, gap=gap)
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # one bad step must not kill the server: fail the in-flight requests
                logger.exception("engine step failed")
                outputs = self.engine.abort_all(f"error: {exc}")
            gap.time("outputs", self._send_outputs, outputs)
            gap.time("stats", self._snapshot_stats)
        self._send_outputs(self.engine.abort_all("abort"))

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._responses.put(output)

    def _snapshot_stats(self) -> None:
        self._stats = self.engine.stats()

    def _apply_commands(self, block: bool, gap: BetweenSteps | Untimed) -> None:
        try:
            command = (gap.time("blocked", self._commands.get, True, self._idle_wait_s) if block
                       else self._commands.get_nowait())
        except queue.Empty:
            return
        while True:
            gap.command(command[0], self._apply, command)
            gap.time("stats", self._snapshot_stats)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "shutdown":
            self._stop.set()
            return
        request_id = args[0]
        try:
            if kind == "add":
                self.engine.add_request(request_id, args[1], **args[2])
            elif kind == "append":
                if request_id in self.engine.requests:  # appends racing a finish/abort are dropped
                    self.engine.append(request_id, **args[1])
            elif kind == "abort":
                output = self.engine.abort(request_id)
                if output is not None:
                    self._responses.put(output)
        except Exception as exc:
            logger.warning("request %r: %s failed: %s", request_id, kind, exc)
            output = self.engine.abort(request_id, f"error: {exc}")
            self._responses.put(output or RequestOutput(request_id, finished=True, finish_reason=f"error: {exc}"))

    def _response_loop(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            # Everything queued behind a slow consumer goes at once, a request's outputs merged into one: a
            # Triton stage sends one response per callback, and at 64 streams a response per step per request
            # fell behind the steps (the talker's first frames waited seconds in this queue), while a merged
            # output costs one send however many steps it covers. Outputs not due yet (output_batching.py) wait
            # here for the next round, or for their hold time to run out.
            try:
                outputs = [self._responses.get(timeout=self._held.wait_s(time.monotonic()))]
            except queue.Empty:
                outputs = []  # only held outputs whose hold ran out
            while outputs and outputs[-1] is not None:
                try:
                    outputs.append(self._responses.get_nowait())
                except queue.Empty:
                    break
            stop = bool(outputs) and outputs[-1] is None
            outputs = [output for output in outputs if output is not None]
            # callbacks embed, cast, concatenate and export on the response thread's own stream (handoff.py); held
            # outputs were waited for, and their tensors marked as used, on that stream in an earlier round (the
            # stream's wait holds for all its later work), so they need neither again when they are merged there
            with self._output_stream.handling((event for output in outputs for event in output.ready_events),
                                              (tensor for output in outputs for tensor in output.device_tensors())):
                gathered = gather_outputs(outputs, held=self._held.take_held())
                # at shutdown everything held goes out
                for pending in (gathered if stop else self._held.due(gathered, time.monotonic())):
                    self._deliver(pending.merged())
            if stop:
                return

    def _deliver(self, output: RequestOutput) -> None:
        with self._callbacks_lock:
            callback = self._callbacks.get(output.request_id)
            if output.finished:
                self._callbacks.pop(output.request_id, None)
        if callback is None:
            return
        if trace.enabled():
            self._trace_first_response(output)
        try:
            callback(output)
        except Exception:
            logger.exception("output callback for request %r failed", output.request_id)

    def _trace_first_response(self, output: RequestOutput) -> None:
        """``<engine>.first_response``: the request's first tokens handed to its send (after the engine made
        them and output batching held them): splits "first token -> the orchestrator has it" into the stage's own
        part and the hand-off between processes. Recorded before the send: a consumer in this process (the
        in-process pipeline) records its receipt inside the callback."""
        request_id = output.request_id
        if output.new_token_ids and request_id not in self._first_tokens_sent:
            trace.event(request_id, f"{self.engine.name}.first_response")
            self._first_tokens_sent.add(request_id)
        if output.finished:
            self._first_tokens_sent.discard(request_id)


class GatheredOutputs:
    """A request's consecutive outputs (``parts``), merged into one only when it is delivered (``merged``). The
    response thread holds a request's outputs for a few rounds (output_batching.py), a part more each round: merged
    every round, the held output's tensors were concatenated again each time (a cat per held stream per step on the
    response thread). ``HeldOutputs`` reads ``request_id``, ``new_token_ids`` and ``finished``, kept up to date."""

    __slots__ = ("request_id", "new_token_ids", "finished", "parts")

    def __init__(self, first: RequestOutput):
        self.request_id, self.new_token_ids, self.finished = first.request_id, first.new_token_ids, first.finished
        self.parts = [first]

    def add(self, output: RequestOutput) -> None:
        self.parts.append(output)
        self.new_token_ids = self.new_token_ids + output.new_token_ids  # (a list of its own: no part's changes)
        self.finished = output.finished

    def merged(self) -> RequestOutput:
        """The parts as one output: their tokens, state rows, extras and events concatenated in order (each tensor
        once), finished and its reason from the last, the states' first position from the first part with states.
        The consumer sees what it would have seen output by output, in fewer calls. One part is itself."""
        parts = self.parts
        if len(parts) == 1:
            return parts[0]
        states, extras, ids_device, events = [], [], [], []
        states_start = parts[0].states_start
        for part in parts:  # (one pass: this runs once per response the stage sends)
            if part.states:
                if not states:
                    states_start = part.states_start
                states.append(part.states)
            extras.append(part.extras)
            if part.token_ids_device is not None:
                ids_device.append(part.token_ids_device)
            events += part.ready_events
        last = parts[-1]
        return RequestOutput(self.request_id, self.new_token_ids, last.finished, last.finish_reason,
                             dict(states[0]) if len(states) == 1 else _concat_all(states), states_start,
                             _concat_all(extras),
                             (ids_device[0] if len(ids_device) == 1 else torch.cat(ids_device)) if ids_device else None,
                             tuple(events))


def gather_outputs(outputs: list[RequestOutput], held: list[GatheredOutputs] = ()) -> list[GatheredOutputs]:
    """One ``GatheredOutputs`` per request (in the order requests first appear), ``held`` ones (from earlier rounds,
    none finished) first, extended by this round's ``outputs``. A request id reused after its request finished
    starts a new one."""
    gathered = list(held)
    open_outputs = {pending.request_id: pending for pending in gathered}
    for output in outputs:
        into = open_outputs.get(output.request_id)
        if into is None:
            into = GatheredOutputs(output)
            gathered.append(into)
        else:
            into.add(output)
        if into.finished:
            open_outputs.pop(output.request_id, None)
        else:
            open_outputs[output.request_id] = into
    return gathered


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request (in the order requests first appear): its consecutive outputs merged
    (``GatheredOutputs.merged``). A request id reused after its request finished starts a new output."""
    return [pending.merged() for pending in gather_outputs(outputs)]


def _concat_all(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    names = {name: None for part in parts for name in part}  # (in order of appearance)
    return {name: torch.cat([part[name] for part in parts if name in part]) for name in names}


def _concat_rows(first: dict[str, torch.Tensor], then: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = first.keys() | then.keys()
    return {name: torch.cat([part[name] for part in (first, then) if name in part]) for name in names}
