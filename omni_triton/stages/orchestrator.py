"""The orchestrator stage: admits requests and runs each one's Session on a worker thread.

The Triton model file only parses its config and hands requests here. Each request gets its own
thread because BLS decoupled calls in this Triton version return blocking iterators: one slow stage
must not stall the other streams. Admission (``admission``): a request starts while fewer than
``max_inflight`` stream and, with a capacity, while one more stream would leave every playing one real time;
otherwise it waits in a FIFO queue (its wait counts in its TTFA: trace event ``orchestrator.admitted`` with
``waited_s``), and past ``admission_queue`` waiting (default: the free slots) it is refused at once with UNAVAILABLE
naming the limit; one that waited ``admission_max_wait`` seconds is refused then, instead of starting late, and one
whose expected wait passes ``admission_max_queue_wait`` seconds is refused at once.
How many more requests it would take before refusing one, and the mark of the latest request it received, are
published at each change (``admission_board``), so that preprocess refuses a request before its work and without
waiting for this process's thread when the instances' room is taken, those on their way here counted.

Cancellation: Triton cancels a request sent to the orchestrator directly, but an ``omni`` ensemble
request cancelled by its client only stops steps not yet scheduled (Triton 2.51), and the
orchestrator is scheduled at once. So a request with ``CONTROL="cancel"`` and the client's request id
cancels that request here; ``omni_triton.client`` sends it along with the stream cancel. It cancels the
requests of that id that had arrived when it came. With several orchestrator instances the control request
may reach an instance that holds no request of that id: that one records it in the server's ``CancelRegistry``,
where the instance that holds it finds it at its next admission poll (``DISPATCH_S``).

Draining (``omni_triton.shared.drain``): before the launcher stops tritonserver it sends ``CONTROL="drain"`` (any
other word than cancel and drain is INVALID_ARG naming CONTROL), while the server still takes requests. From then on
new and queued requests are refused with UNAVAILABLE "server shutting down", running sessions may run for the
request's ``drain_s`` (default ``DRAIN_S``), then the rest are cancelled and end with UNAVAILABLE "server shutting
down" while their stages still accept the aborts; the drain request is answered once no session is left (or
``ABORTS_S`` after the bound). With several instances the one that gets it records the drain in the
``CancelRegistry``; every instance finds it at its next admission poll, marks itself drained there once it
holds no session, and the drain is answered once every instance is (one drain request suffices: Triton hands it
to any one instance). A session whose stage call is refused with "Server not ready" (a stop that did not drain)
ends with UNAVAILABLE too.

A client that vanishes without cancelling (killed, network gone) is not seen by the running
orchestrator step for the same reason: its request runs to its natural end. The optional request
parameter ``deadline_s`` (a Triton request parameter, which the ensemble passes to every step)
bounds that: past it the request is cancelled (``CancelWatchdog`` rings the session's alarm within
``POLL_S``) and every stage frees its state.

A running session sleeps in its waits until its ``Alarm`` rings: one ``CancelWatchdog`` thread asks Triton
whether any running request was cancelled, and looks at the cancel flags and deadlines, every ``POLL_S``;
the stage supervisor rings every session when a stage dies.

One route per Orchestrator (``PipelineRoute``): the Triton model of each stage it calls and the GPU their outputs
are asked to land on. With one pipeline that is the stages by their own names; with ``serve --pipelines N`` the
server runs orchestrator instances per pipeline (``placement.orchestrator_instance``), each an Orchestrator of
its pipeline's route (``pipeline_route``): Triton hands each new request to whichever instance is free to take it,
and the request runs on that instance's pipeline from its first call to its last: every BLS call of its session
goes to that pipeline's models by name (``thinker_p1``, ...), so its tensors stay on that pipeline's GPUs and its
aborts reach the one thinker, talker sequence and vocoder stream that hold it. Admission counts, limits and
capacity are the instance's: per pipeline, and with several instances per pipeline (``--instances
orchestrator=K``, so that the orchestrator's Python work runs in K processes) each takes 1/K of them
(``OrchestratorSlot``, ``admission.split_limit``). Request ids carry the process's pid (``<client id>#<pid>.<n>``:
the pipeline's stages key their state on them).

A stage whose stub process dies (see ``stage_supervisor``): the requests waiting on it end with an
UNAVAILABLE error naming the stage, the other stages drop their state for them, new requests are refused
with UNAVAILABLE until the stage is reloaded, and then served by its fresh stub. Each instance watches its own
route's stages, so with several pipelines only the requests on the stage's own pipeline fail, and only that
pipeline's instances refuse new ones; of several instances of one pipeline only the first reloads the stage, the
others wait until the reloaded model serves.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tokenizers import Tokenizer

from omni_triton import trace
from omni_triton.error_tags import triton_error
from omni_triton.models.code2wav.vocoder import Code2WavConfig, exact_left_context_frames
from omni_triton.pipeline.code2wav.pacing import ChunkPacer
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy, Code2WavStream
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer
from omni_triton.pipeline.alarm import Alarm
from omni_triton.pipeline.session import Cancelled, Session, SessionParams, StageFailed
from omni_triton.shared.admission_board import LET_THROUGH, BoardWriter
from omni_triton.shared.cancel_registry import CancelRegistry
from omni_triton.shared.drain import SHUTTING_DOWN, control_word, drain_seconds
from omni_triton.shared.placement import OrchestratorSlot, Placement
from omni_triton.shared.request_parameters import seconds_parameter
from omni_triton.stages.admission import Admission, RealtimeCapacity, split_limit
from omni_triton.stages.bls_clients import BlsStageClients
from omni_triton.stages.cancel_watchdog import CancelWatchdog
from omni_triton.stages.metrics import HostHopCounter, torch_memory_gauges
from omni_triton.shared.settings import CHUNK_PACING
from omni_triton.stages.running_threads import RunningThreads, report_still_running
from omni_triton.stages.stage_io import from_torch
from omni_triton.stages.stage_supervisor import StageSupervisor

logger = logging.getLogger(__name__)

REQUEST_INPUTS = ("INPUT_IDS", "AUDIO_FEATURES", "MAX_TOKENS", "MIN_TOKENS", "SPEAKER_ID", "TEMPERATURE", "TOP_P",
                  "TOP_K", "REPETITION_PENALTY", "TALKER_REPETITION_PENALTY", "SEED", "RETURN_AUDIO", "IGNORE_EOS",
                  "MAX_AUDIO_FRAMES", "MIN_AUDIO_FRAMES", "SEQUENTIAL")
BLS_STAGES = ("thinker", "talker", "code2wav")
DISPATCH_S = 0.05  # how often waiting requests are looked at (cancelled? capacity freed?) without an event
CAPACITY_SAMPLE_S = 0.5  # frames received are turned into a capacity observation this often
# A session asks whether its stage died at most every poll (session.POLL_S); a stage seen alive this recently
# counts as alive, so a death is noticed this much later at most (the final error is mapped fresh)
STAGE_ALIVE_MAX_AGE_S = 0.05
# Past a drain's bound the sessions left are cancelled; their aborts and final responses get this long before the
# drain is answered anyway
ABORTS_S = 2.0
# At unload, sessions still running this long after the stop began are logged with where they wait
SESSIONS_END_S = 2.0


@dataclass(frozen=True)
class PipelineRoute:
    """The pipeline an orchestrator reaches: the Triton model of each stage, the GPU where its stage outputs are
    asked to land (None: host memory, a CPU deployment), and its index among the server's pipelines (traces)."""
    models: Mapping[str, str]
    gpu: int | None
    index: int = 0


def pipeline_route(placement: Placement, pipeline: int, device: torch.device) -> PipelineRoute:
    """The route to ``placement``'s ``pipeline``, for an orchestrator on ``device`` (on the CPU every output
    lands in host memory)."""
    return PipelineRoute(placement.models(pipeline),
                         placement.pipeline_gpu(pipeline) if device.type == "cuda" else None, pipeline)


class Orchestrator:
    def __init__(self, pb_utils: Any, checkpoint_dir: str | Path, device: torch.device, policy: ChunkPolicy,
                 max_inflight: int, chunk_pacing: str = "adaptive", admission_queue: int | None = None,
                 capacity: RealtimeCapacity | None = None, stage_instances: Mapping[str, int] | None = None,
                 max_starting: int = 0, route: PipelineRoute | None = None,
                 shared_cancels: CancelRegistry | None = None, metric_labels: Mapping[str, str] | None = None,
                 slot: OrchestratorSlot = OrchestratorSlot(), admission_max_wait_s: float = 0.0,
                 board: BoardWriter | None = None, admission_max_queue_wait_s: float = 0.0):
        """``capacity``: admission by real-time capacity (None: by ``max_inflight`` alone; its ``share`` is
        ``slot.per_pipeline``); ``max_starting``: streams admitted and not yet playing at once (0: no limit);
        ``admission_queue``: requests that may wait (None: the free slots), none longer than
        ``admission_max_wait_s`` (0: no limit), none queued whose expected wait (learned from this instance's own
        queue and streams: ``queue_drain``) is longer than ``admission_max_queue_wait_s`` (0: no limit);
        ``max_inflight``, ``admission_queue`` and ``max_starting`` hold for this instance's pipeline, and each of
        its ``slot.per_pipeline`` instances takes its part (``split_limit``).
        ``route``: the stages' models and where their outputs land (default: the stages by their own names, outputs
        on ``device``); ``stage_instances``: stage -> instances of each of its models. ``shared_cancels``: where the
        server's other orchestrator instances record cancels of requests they do not hold (None: this is the only
        instance);
        ``metric_labels``: labels of this instance's metrics beside ``stage``; ``slot``: which instance this is;
        ``board``: where this instance says whether it would refuse a new request (``admission_board``: preprocess
        refuses before its work when every instance would), updated at each change of its admission."""
        if chunk_pacing not in CHUNK_PACING:
            raise ValueError(f"chunk_pacing must be one of {CHUNK_PACING}, got {chunk_pacing!r}")
        self._pb = pb_utils
        self._host_hops = HostHopCounter(pb_utils, "orchestrator", on_gpu=device.type == "cuda",
                                         labels=dict(metric_labels or {}))
        self._tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
        code2wav_config = Code2WavConfig.from_pretrained(checkpoint_dir)
        self._num_quantizers = code2wav_config.num_quantizers
        self._policy = policy.resolved(exact_left_context_frames(code2wav_config))
        self._route = route or PipelineRoute({stage: stage for stage in BLS_STAGES},
                                             device.index if device.type == "cuda" else None)
        self._chunk_pacing = chunk_pacing
        if capacity is not None and capacity.share != slot.per_pipeline:
            raise ValueError(f"capacity share {capacity.share} != {slot.per_pipeline} instances per pipeline")
        pipeline_inflight, max_inflight = max_inflight, split_limit(max_inflight, slot.per_pipeline)
        self._admission = Admission(max_inflight, split_limit(admission_queue, slot.per_pipeline), capacity,
                                    split_limit(max_starting, slot.per_pipeline), admission_max_wait_s,
                                    max_held=pipeline_inflight, max_queue_wait_s=admission_max_queue_wait_s)
        self._board, self._board_lock = board, threading.Lock()
        self._latest_let_through = 0  # the board: preprocess's requests up to this mark are no longer on their way
        self._publish()
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="omni-request")
        self._sessions = RunningThreads()  # request id -> its pool thread, while its _run runs
        self._slot = slot
        self._request_counter = 0
        self._lock = threading.Lock()
        self._active: dict[str, Code2WavStream | None] = {}  # request id -> its audio stream, once opened
        # client request id -> its sessions' flags -> when each request arrived (a cancel applies to those before it)
        self._cancel_events: dict[str, dict[threading.Event, float]] = {}
        self._shared_cancels = shared_cancels
        self._drain_until: float | None = None  # once draining: until when running sessions may run (monotonic)
        self._drain_expired = False  # the bound passed: the sessions left were cancelled by the drain
        self._marked_drained = False
        self._unanswered = 0  # sessions started whose final response is not sent yet (a drain waits for them)
        self._watchdog = CancelWatchdog()
        self._stages = StageSupervisor({self._route.models[stage]: (stage_instances or {}).get(stage, 1)
                                        for stage in BLS_STAGES}, reloads=slot.index == 0,
                                       on_death=self._watchdog.ring_all)
        # capacity samples (dispatcher thread only): frames per stream at the last sample, and the streams that
        # received frames in the window before it
        self._seen_frames: dict[str, int] = {}
        self._producing: set[str] = set()
        self._stopping = threading.Event()
        self._wake = threading.Event()  # a stream ended: a waiting request may start
        self._dispatcher = threading.Thread(target=self._dispatch, name="omni-admission", daemon=True)
        self._dispatcher.start()

    def snapshot(self) -> dict[str, float]:
        """Gauge values of this instance's pipeline: requests in flight, codec frames they hold that are not
        decoded yet, admission; on a GPU, what this process's torch allocator holds there."""
        with self._lock:
            streams = [stream for stream in self._active.values() if stream is not None]
            active = len(self._active)
        admission = self._admission
        capacity = (admission.capacity.instance_audio_s_per_s(max(1, admission.running)) if admission.capacity
                    else 0.0)
        return {"omni_active_requests": active,
                "omni_pending_audio_frames": sum(stream.pending_frames for stream in streams),
                "omni_admission_queue_length": admission.queued,
                "omni_admission_waited_requests": admission.waited,
                "omni_admission_wait_seconds": admission.wait_s,
                "omni_admission_refused_requests": admission.refused,
                "omni_admission_expected_wait_seconds": admission.expected_wait_s,
                "omni_realtime_capacity_audio_s_per_s": capacity,
                **torch_memory_gauges(self._route.gpu)}

    def submit(self, request: Any) -> None:
        """Start streaming ``request``; every response goes out through its response sender."""
        sender = request.get_response_sender()
        control = self._pb.get_input_tensor_by_name(request, "CONTROL")
        if control is not None:
            self._control(request, control.as_numpy().reshape(-1)[0], sender)
            return
        mark = self._pb.get_input_tensor_by_name(request, LET_THROUGH)
        if mark is not None:  # an omni request, preprocess's mark (a direct caller's has none)
            with self._board_lock:
                self._latest_let_through = max(self._latest_let_through, int(mark.as_numpy().reshape(-1)[0]))
        try:
            self._admit(request, sender)
        finally:
            self._publish()  # received, whatever its end: no longer on its way for preprocess

    def _admit(self, request: Any, sender: Any) -> None:
        if self._drain_until is not None:
            self._refuse(sender, SHUTTING_DOWN)
            return
        down = self._stages.unavailable()  # a death the watcher has not seen yet: the request fails at the stage
        if down is not None:
            self._refuse(sender, down)
            return
        inputs = {name: self._pb.get_input_tensor_by_name(request, name) for name in REQUEST_INPUTS}
        missing = [name for name, tensor in inputs.items() if tensor is None]
        try:
            if missing:
                raise ValueError(f"missing inputs {missing}")
            deadline = _deadline(request)
        except ValueError as exc:
            error = triton_error(self._pb, "INVALID_ARG", str(exc))
            sender.send(self._pb.InferenceResponse(error=error), flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        cancelled = threading.Event()
        client_id = request.request_id()
        request_id = self._request_id(request)
        trace.event(request_id, "orchestrator.received")
        ticket = _Ticket(request, sender, inputs, request_id, client_id, cancelled, deadline,
                         _CancelCheck(request, cancelled, deadline))
        with self._lock:  # before it may start: a cancel sent while it waits must find it
            self._cancel_events.setdefault(client_id, {})[cancelled] = time.monotonic()
        arrived = time.monotonic()
        decision = self._admission.arrive(ticket, arrived)
        self._publish()  # before its start or refusal: preprocess sees its place taken at once
        if decision == "start":
            self._start(ticket, waited_s=0.0, admitted=arrived)
        elif decision == "refused":
            self._forget(ticket)
            self._refuse(sender, self._admission.refusal())

    def _publish(self) -> None:
        """Say on the board how many more requests would be taken now, the refusal after them, and the latest
        request received (in order: the lock keeps an older state from overwriting a newer one)."""
        if self._board is not None:
            with self._board_lock:
                self._board.publish(*self._admission.outlook(), latest=self._latest_let_through)

    def _refuse(self, sender: Any, message: str) -> None:
        error = triton_error(self._pb, "UNAVAILABLE", message)
        sender.send(self._pb.InferenceResponse(error=error), flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _start(self, ticket: "_Ticket", waited_s: float, admitted: float) -> None:
        """``admitted``: when admission counted it as running (monotonic): its start and lifetime count from there,
        not from its arrival, for admission's prior of the queue's pace."""
        trace.event(ticket.request_id, "orchestrator.admitted", waited_s=waited_s, pipeline=self._route.index)
        with self._lock:  # before its thread runs: the gauges count it from now on
            self._active[ticket.request_id] = None
            self._unanswered += 1
        self._pool.submit(self._run, ticket, admitted)

    def _forget(self, ticket: "_Ticket") -> None:
        with self._lock:
            events = self._cancel_events[ticket.client_id]
            events.pop(ticket.cancelled, None)
            if not events:
                del self._cancel_events[ticket.client_id]

    def _dispatch(self) -> None:
        """Starts waiting requests in arrival order when a stream ends or capacity frees up, ends those
        cancelled or past their deadline while waiting, and feeds the capacity estimate."""
        last_sample = time.monotonic()
        while not self._stopping.is_set():
            self._wake.wait(DISPATCH_S)
            self._wake.clear()
            try:
                last_sample = self._dispatch_once(last_sample)
            except Exception:  # a dead dispatcher would leave every waiting request waiting forever
                logger.exception("admission dispatcher")

    def _dispatch_once(self, last_sample: float) -> float:
        """One look at the queue; returns when capacity was last sampled."""
        if self._shared_cancels is not None:
            self._take_shared_cancels()
            until = self._shared_cancels.drain_until()
            if until is not None:
                self._begin_drain(until)
        now = time.monotonic()
        if self._drain_until is not None:
            self._drain_step(now)
        for ticket in self._admission.drop(lambda ticket: ticket.is_cancelled()):
            self._forget(ticket)
            reason = "deadline_s exceeded" if now > ticket.deadline else "request cancelled"
            error = triton_error(self._pb, "CANCELLED", f"{reason} while waiting for admission")
            ticket.sender.send(self._pb.InferenceResponse(error=error),
                               flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        for ticket, waited_s in self._admission.expired(now):  # refused now rather than started late
            self._forget(ticket)
            self._refuse(ticket.sender, self._admission.expiry(waited_s))
        if self._admission.capacity is not None and now - last_sample >= CAPACITY_SAMPLE_S:
            self._observe_capacity(now - last_sample)
            last_sample = now
        down = self._stages.unavailable()
        if down is not None:  # a waiting request started now would fail at the dead stage: refused as new ones are
            for ticket in self._admission.drop(lambda ticket: True):
                self._forget(ticket)
                self._refuse(ticket.sender, down)
            return last_sample
        for ticket, waited_s in self._admission.due(now):
            self._start(ticket, waited_s, admitted=now)
        self._publish()
        return last_sample

    def _observe_capacity(self, seconds: float) -> None:
        """Frames received since the last sample -> the capacity estimate. Only streams that received frames in
        the sample before too and still run count: one that started or ended inside the window, or waited for
        thinker text, got frames for part of it only and would make the server look slower than it is."""
        with self._lock:
            totals = {rid: stream.total_frames for rid, stream in self._active.items() if stream is not None}
        deltas = {rid: total - self._seen_frames.get(rid, 0) for rid, total in totals.items()}
        steady = [delta for rid, delta in deltas.items() if delta > 0 and rid in self._producing]
        self._producing = {rid for rid, delta in deltas.items() if delta > 0}
        self._seen_frames = totals
        self._admission.capacity.observe(len(steady), sum(steady), seconds, batch=len(self._producing))

    def _control(self, request: Any, raw_word: bytes, sender: Any) -> None:
        pb = self._pb
        try:
            word = control_word(raw_word)
            drain_s = drain_seconds(request.parameters()) if word == "drain" else 0.0
        except ValueError as exc:
            error = triton_error(pb, "INVALID_ARG", str(exc))
            sender.send(pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if word == "drain":
            self._drain(time.monotonic() + drain_s, sender)
            return
        client_id = request.request_id()
        now = time.monotonic()
        with self._lock:
            events = list(self._cancel_events.get(client_id, ()))
            for event in events:
                event.set()
        if not events and self._shared_cancels is not None:  # held by another instance, if any
            self._shared_cancels.record(client_id, now)
        # which instance a cancel reached, and whether it held the request (tests see both routings)
        trace.record("orchestrator_cancel", now, client_id=client_id, held=len(events), pipeline=self._route.index,
                     instance=self._slot.index)
        sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _drain(self, until: float, sender: Any) -> None:
        """Start draining (all instances: the registry) and answer ``sender`` once every instance holds no session,
        or ``ABORTS_S`` after ``until``, from a thread of its own (Triton's ``execute`` must return)."""
        self._begin_drain(until)
        if self._shared_cancels is not None:
            self._shared_cancels.record_drain(self._drain_until)
        trace.record("orchestrator_drain", time.monotonic(), pipeline=self._route.index)

        def answer() -> None:
            while time.monotonic() < self._drain_until + ABORTS_S and not self._drained_everywhere():
                time.sleep(DISPATCH_S)
            sender.send(flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        threading.Thread(target=answer, name="omni-drain", daemon=True).start()

    def _begin_drain(self, until: float) -> None:
        with self._lock:
            if self._drain_until is None or until < self._drain_until:
                self._drain_until = until
        self._wake.set()

    def _drain_step(self, now: float) -> None:
        """Dispatcher, while draining: refuse what waits, cancel what runs past the bound, say when nothing is left."""
        for ticket in self._admission.drop(lambda ticket: True):
            self._forget(ticket)
            self._refuse(ticket.sender, SHUTTING_DOWN)
        if now >= self._drain_until and not self._drain_expired:
            with self._lock:
                self._drain_expired = True  # before the sessions see it: they end as shut down, not cancelled
                for events in self._cancel_events.values():
                    for event in events:
                        event.set()
        if self._shared_cancels is not None and not self._marked_drained and self._answered_all():
            self._marked_drained = True
            self._shared_cancels.mark_drained(f"{self._route.index}.{self._slot.index}")

    def _answered_all(self) -> bool:
        with self._lock:
            return self._unanswered == 0

    def _drained_everywhere(self) -> bool:
        if not self._answered_all():
            return False
        return self._shared_cancels is None or self._shared_cancels.drained() >= self._slot.total

    def _take_shared_cancels(self) -> None:
        """Apply the cancels other instances recorded for requests held here (those that had arrived by then)."""
        with self._lock:
            held = {client_id: min(events.values()) for client_id, events in self._cancel_events.items()}
        for client_id, at in self._shared_cancels.take(held).items():
            with self._lock:
                for event, arrived in self._cancel_events.get(client_id, {}).items():
                    if arrived <= at:
                        event.set()

    def shutdown(self) -> None:
        self._stopping.set()
        self._dispatcher.join()
        for ticket in self._admission.drop(lambda ticket: True):  # nothing will start them now
            self._refuse(ticket.sender, "server shutting down")
        self._stages.stop()
        # the pool's shutdown waits for every session: one still running now is stuck (a drain ends them first),
        # and the unload, with tritonserver's exit timeout, waits for it: say where
        report_still_running(self._sessions, SESSIONS_END_S, logger.warning)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._watchdog.stop()
        if self._board is not None:
            self._board.close()
        self._host_hops.close()
        if self._shared_cancels is not None:
            self._shared_cancels.close()

    def _request_id(self, request: Any) -> str:
        # Triton's own id may be empty or reused by clients; stages key their state on this one. The pid tells it
        # apart from every other orchestrator process's, which count from 1 too: the pipeline's other instances, and
        # the stub this one replaced (a reload alone: its requests may still be held in the stages).
        with self._lock:
            self._request_counter += 1
            return f"{request.request_id() or 'req'}#{os.getpid()}.{self._request_counter}"

    def _run(self, ticket: "_Ticket", admitted: float) -> None:
        self._sessions.enter(ticket.request_id)
        try:
            self._serve(ticket, admitted)
        finally:
            self._sessions.leave(ticket.request_id)

    def _serve(self, ticket: "_Ticket", admitted: float) -> None:
        pb = self._pb
        sender, inputs, request_id, deadline = ticket.sender, ticket.inputs, ticket.request_id, ticket.deadline
        send_lock = threading.Lock()

        played = []  # its first audio went out: its start is over (admission)

        def emit(text: str, audio: torch.Tensor | None) -> None:
            outputs = [pb.Tensor("TEXT_DELTA", np.array([text.encode("utf-8")], dtype=np.object_))]
            if audio is None:
                outputs.append(pb.Tensor("AUDIO", np.zeros(0, dtype=np.float32)))
            else:
                # the client-facing hop: gRPC sends from host memory, so copy here, once, off the GPU
                outputs.append(from_torch(pb, "AUDIO", audio.to(device="cpu", dtype=torch.float32)))
            with send_lock:
                sender.send(pb.InferenceResponse(outputs))
                if audio is not None and not played:
                    played.append(True)
                    self._admission.playing(time.monotonic() - admitted)
                    self._publish()
                    self._wake.set()  # a waiting stream may start now

        generations = self._stages.generations()
        clients = BlsStageClients(pb, inputs, self._route.gpu, self._host_hops.check, stage_down=self._stages.is_down,
                                  models=self._route.models)
        alarm = Alarm()
        self._watchdog.watch(request_id, ticket.request, ticket.cancelled, deadline, alarm)  # unwatched in finally
        try:
            session = Session(
                request_id,
                SessionParams(return_audio=_flag(inputs["RETURN_AUDIO"]), sequential=_flag(inputs["SEQUENTIAL"])),
                clients,
                IncrementalDetokenizer(self._tokenizer),
                lambda: self._open_audio_stream(request_id),
                # no IPC here: the watchdog asks Triton and sets the flag
                is_cancelled=lambda: ticket.cancelled.is_set() or time.monotonic() > deadline,
                stage_failure=lambda stage: self._stages.failure(generations, self._route.models[stage],
                                                                 max_age_s=STAGE_ALIVE_MAX_AGE_S),
                alarm=alarm,
            )
            session.run(emit)
            error = None
        except Cancelled:
            if self._drain_expired:
                error = triton_error(pb, "UNAVAILABLE", f"{SHUTTING_DOWN}: the drain's bound (drain_s) passed")
            else:
                reason = "deadline_s exceeded" if time.monotonic() > deadline else "request cancelled"
                error = triton_error(pb, "CANCELLED", reason)
        except Exception as exc:  # one request's failure is reported to its client, never raised into Triton
            if "Server not ready" in str(exc):  # Triton stopping without a drain refuses every BLS call
                logger.warning("request %s: %s", request_id, exc)
                error = triton_error(pb, "UNAVAILABLE", f"{SHUTTING_DOWN}: {exc}")
            else:
                error = self._failure_error(exc, generations, request_id)
        finally:
            self._watchdog.unwatch(request_id)  # before the final response: Triton is not asked after it
            # the slot first: once the gauges say this request is gone, a new one is admitted
            self._forget(ticket)
            with send_lock:  # not while emit counts its first audio
                self._admission.finished(time.monotonic() - admitted, played=bool(played))
            self._publish()  # before the final response: its client's next request must not find it full
            with self._lock:
                del self._active[request_id]
            self._wake.set()
        with send_lock:
            try:
                if error is None:
                    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    sender.send(pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # the client is gone: nothing left to tell it
                logger.info("request %s: final response not delivered", request_id)
        with self._lock:
            self._unanswered -= 1

    def _failure_error(self, exc: Exception, generations: Any, request_id: str) -> Any:
        """The error of a session that failed: UNAVAILABLE naming a stage that died, else INTERNAL."""
        # a call to a stage that died meanwhile fails in its own words ("Stub process ... is not healthy")
        failure = str(exc) if isinstance(exc, StageFailed) else self._stages.failure(generations)
        if failure is not None:
            logger.warning("request %s: %s", request_id, failure)
            return triton_error(self._pb, "UNAVAILABLE", failure)
        logger.exception("request %s failed", request_id)
        return triton_error(self._pb, "INTERNAL", f"{type(exc).__name__}: {exc}")

    def _open_audio_stream(self, request_id: str) -> Code2WavStream:
        pacer = ChunkPacer(self._policy) if self._chunk_pacing == "adaptive" else None
        stream = Code2WavStream(self._policy, self._num_quantizers, pacer)
        with self._lock:
            self._active[request_id] = stream
        return stream


def _deadline(request: Any) -> float:
    """The monotonic time by which ``request`` must end: now + its ``deadline_s`` parameter, else never."""
    value = seconds_parameter(request.parameters(), "deadline_s", zero_allowed=False)
    return math.inf if value is None else time.monotonic() + value


@dataclass
class _Ticket:
    """A request from its arrival on: what its session needs, whether it waits in the admission queue or runs."""
    request: Any
    sender: Any
    inputs: dict[str, Any]
    request_id: str
    client_id: str
    cancelled: threading.Event
    deadline: float
    is_cancelled: Callable[[], bool]


class _CancelCheck:
    """Whether a request waiting for admission should stop: cancelled by a control request, past its deadline,
    or cancelled in Triton (asked by the admission dispatcher; once it runs, ``CancelWatchdog`` asks instead).
    ``request.is_cancelled()`` is an IPC round trip on the request's own shared-memory slot and is not safe to
    call concurrently, so it is serialized here and asked at most every ``poll_s``."""

    def __init__(self, request: Any, cancelled: threading.Event, deadline: float, poll_s: float = 0.05):
        self._request, self._cancelled, self._deadline, self._poll_s = request, cancelled, deadline, poll_s
        self._lock = threading.Lock()
        self._asked_at = float("-inf")

    def __call__(self) -> bool:
        if self._cancelled.is_set() or time.monotonic() > self._deadline:
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._asked_at >= self._poll_s:
                self._asked_at = now
                if self._request.is_cancelled():
                    self._cancelled.set()
        return self._cancelled.is_set()


def _flag(tensor: Any) -> bool:
    return bool(tensor.as_numpy().reshape(-1)[0])
