"""One request's trip through thinker -> talker -> code2wav, independent of how stages are reached.

The Triton orchestrator (BLS calls) and the in-process pipeline (direct engine calls) both run this
class; they differ only in the ``StageClients`` they pass. Streaming mode overlaps everything:
text deltas leave as soon as the thinker produces them, every thinker chunk is forwarded to the
talker while the thinker keeps generating, and codec frames are decoded in small left-context
chunks as they arrive. Sequential mode runs each stage to completion before the next (the baseline).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar

import torch

from omni_triton import trace
from omni_triton.pipeline.alarm import Alarm
from omni_triton.pipeline.code2wav.chunking import ChunkJob, Code2WavStream
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer


@dataclass
class ThinkerChunk:
    """What the thinker stage streams: new token ids plus an opaque payload the talker stage consumes."""

    token_ids: list[int]
    finished: bool
    payload: Any = None  # stage-specific tensors (embeddings, hidden states), forwarded untouched


class StageClients(Protocol):
    def thinker(self, request_id: str) -> Iterable[ThinkerChunk]: ...
    def talker_start(self, request_id: str, chunk: ThinkerChunk) -> Iterator[torch.Tensor]: ...
    def talker_append(self, request_id: str, chunk: ThinkerChunk) -> None: ...
    def merge_payloads(self, payloads: list[Any]) -> Any:
        """One payload for consecutive thinker chunks past the first (rows concatenated in order)."""
    def code2wav(self, codes: torch.Tensor, left_context_frames: int, urgent: bool = False) -> torch.Tensor:
        """codes [G, N] (left context first) -> the new samples only. ``urgent``: the listener has little audio
        left, so the chunk goes ahead of those queued (``ChunkPacer.urgent``)."""
    def code2wav_stream(self, codes: torch.Tensor, first: bool, urgent: bool = False) -> torch.Tensor:
        """codes [G, n]: this request's next new frames; the code2wav stage carries the vocoder state between
        calls (``first`` opens it) -> the new samples. ``urgent`` as ``code2wav``'s."""
    def code2wav_close(self) -> None:
        """Free this request's code2wav stream state, if it has one (idempotent, never raises)."""
    def abort(self, request_id: str) -> None: ...


class Cancelled(Exception):
    """The client went away; every stage was told to drop the request."""


class StageFailed(RuntimeError):
    """A stage stopped serving the request (its process died); the message names the stage."""


# How often a wait on a stage looks up from it: for a cancel, the deadline, or a stage that died. A session given an
# ``Alarm`` looks up when it rings instead, and at an item when its last look is this old.
POLL_S = 0.05
T = TypeVar("T")


@dataclass
class SessionParams:
    return_audio: bool
    sequential: bool


Emit = Callable[[str, torch.Tensor | None], None]  # (text delta, audio samples or None)


class Session:
    def __init__(self, request_id: str, params: SessionParams, clients: StageClients,
                 detokenizer: IncrementalDetokenizer, audio_stream_factory: Callable[[], Code2WavStream],
                 is_cancelled: Callable[[], bool] = lambda: False,
                 stage_failure: Callable[[str], str | None] = lambda stage: None, alarm: Alarm | None = None):
        self.request_id = request_id
        self.params = params
        self.clients = clients
        self.detokenizer = detokenizer
        self.audio_stream_factory = audio_stream_factory
        self.is_cancelled = is_cancelled
        self.stage_failure = stage_failure  # stage -> why it can no longer serve this request, or None
        # rung when ``is_cancelled`` or ``stage_failure`` may have changed: waits sleep until then (None: they poll)
        self.alarm = alarm
        self.audio_stream_stateful = False  # the code2wav stage holds state for this request's audio stream

    def run(self, emit: Emit) -> None:
        """Stream the whole request through ``emit``; raises Cancelled if the client cancels (or the
        caller's ``is_cancelled`` says so), StageFailed if a stage it waits on stops serving it."""
        try:
            if self.params.sequential:
                self._run_sequential(emit)
            else:
                self._run_streaming(emit)
        except BaseException:
            self.clients.abort(self.request_id)
            raise

    # -- streaming ---------------------------------------------------------------------------------
    def _run_streaming(self, emit: Emit) -> None:
        audio_worker: _AudioWorker | None = None

        def check() -> None:
            self._check("thinker")
            if audio_worker is not None:
                audio_worker.raise_error()  # a failed audio path ends the request now, not when text ends
                # its code2wav call to a stage that died returns only with Triton's own verdict, 1-3 s later
                self._check("code2wav")

        trace.event(self.request_id, "session.start")
        first_chunk = True
        try:
            # Every thinker chunk that queued while this thread was busy (an append is a round trip to the
            # talker) goes on as one: one text delta and one append, so the talker's trailing text never falls
            # further behind the thinker than one round trip, however many streams share the orchestrator.
            for chunks in self._stream("thinker", self.clients.thinker(self.request_id), check, coalesce=True):
                if first_chunk:
                    trace.event(self.request_id, "session.thinker_first_chunk", tokens=len(chunks[0].token_ids))
                    first_chunk = False
                delta = self.detokenizer.push([token for chunk in chunks for token in chunk.token_ids])
                if chunks[-1].finished:
                    delta += self.detokenizer.flush()
                if delta:
                    emit(delta, None)
                if not self.params.return_audio:
                    continue
                if audio_worker is None:
                    trace.event(self.request_id, "session.talker_start")
                    frames = self.clients.talker_start(self.request_id, chunks[0])
                    stopped = threading.Event()
                    audio_stream = self.audio_stream_factory()
                    self.audio_stream_stateful = audio_stream.policy.stateful
                    # the frames' checks stand for the whole audio path: join looks up only during code2wav calls
                    audio_worker = _AudioWorker(
                        lambda idle, idle_wait_s: self._stream(
                            "talker", frames, lambda: self._check("talker", "code2wav"), until=stopped, idle=idle,
                            idle_wait_s=idle_wait_s),
                        self.clients, audio_stream, emit, stopped, self.request_id, self.alarm)
                    chunks = chunks[1:]
                if chunks:
                    self.clients.talker_append(self.request_id, self._merged(chunks))
            if audio_worker is not None:
                audio_worker.join(lambda: self._check("code2wav"), self.alarm)
        finally:
            if audio_worker is not None:
                audio_worker.stop(leave_call=self.stage_failure("code2wav") is not None)
                if self.audio_stream_stateful:
                    self.clients.code2wav_close()  # after stop: no chunk of this stream is sent after it
            trace.event(self.request_id, "session.finished")  # ends the level's window in trace breakdowns

    # -- sequential (baseline) -------------------------------------------------------------------
    def _run_sequential(self, emit: Emit) -> None:
        chunks = list(self._stream("thinker", self.clients.thinker(self.request_id)))
        token_ids = [t for c in chunks for t in c.token_ids]
        text = self.detokenizer.push(token_ids) + self.detokenizer.flush()
        if text:
            emit(text, None)
        if not self.params.return_audio or not chunks:
            return
        frames = self.clients.talker_start(self.request_id, chunks[0])
        for chunk in chunks[1:]:
            self.clients.talker_append(self.request_id, chunk)
        all_frames = list(self._stream("talker", frames))
        if all_frames:
            codes = torch.cat(all_frames, dim=0).T.contiguous()
            emit("", self.clients.code2wav(codes, 0))

    def _merged(self, chunks: list[ThinkerChunk]) -> ThinkerChunk:
        if len(chunks) == 1:
            return chunks[0]
        if trace.enabled():
            trace.event(self.request_id, "session.appends_coalesced", chunks=len(chunks))
        return ThinkerChunk([token for chunk in chunks for token in chunk.token_ids], chunks[-1].finished,
                            self.clients.merge_payloads([chunk.payload for chunk in chunks]))

    def _check(self, *stages: str) -> None:
        """Raise if the request must stop while it waits on ``stages``."""
        if self.is_cancelled():
            raise Cancelled(self.request_id)
        for stage in stages:
            failure = self.stage_failure(stage)
            if failure is not None:
                raise StageFailed(failure)

    def _stream(self, stage: str, items: Iterable[T], check: Callable[[], None] | None = None,
                until: threading.Event | None = None, coalesce: bool = False,
                idle: Callable[[], None] | None = None,
                idle_wait_s: Callable[[], float | None] | None = None) -> Iterator[Any]:
        """``items`` (a stage's response stream), read on a thread of their own and checked (default:
        ``_check(stage)``) at least every ``POLL_S``: at an item when the last check is that old, and at every
        ``POLL_S`` without one, when ``idle`` is called too (in the consuming thread); it ends early once ``until``
        is set. With the session's ``alarm`` it sleeps until an item or a ring instead (then checks, and calls
        ``idle``), or for ``idle_wait_s()`` where that says a timed ``idle`` is due (None: none is). A check per
        item cost more than the item (a talker streams a frame a response; the check asks the server whether the
        request was cancelled and the stage supervisor whether the stage lives), and said nothing newer: both
        answers are refreshed at most every ``POLL_S`` anyway.
        With ``coalesce``, it yields lists: each item with every later one already waiting in the queue.

        A BLS stream in this Triton version cannot be cancelled, and one from a stage whose process died
        never ends: waiting on it directly would hold the request, its admission slot and the other stages'
        state forever. The reader thread always reads the stream to its end, even after the session stops
        listening (an abort closes it): left unread, its responses back up into the stage, whose sends then
        block, stalling every other stream with it (seen under load after a code2wav error in one request).
        A stream from a dead stage never ends, so its reader thread stays blocked: one idle thread per
        request that was in flight when the stage died.
        """
        check = check or (lambda: self._check(stage))
        responses: queue.SimpleQueue = queue.SimpleQueue()
        listening = threading.Event()
        listening.set()
        delivering = threading.Lock()  # nothing is put after the session stopped listening and emptied the queue

        def deliver(entry: tuple[Any, BaseException | None]) -> None:
            with delivering:
                if listening.is_set():
                    responses.put(entry)

        def read() -> None:
            try:
                for item in items:
                    deliver((item, None))
                deliver((_END, None))
            except BaseException as exc:  # re-raised in the session's thread
                deliver((_END, exc))

        threading.Thread(target=read, name=f"{stage}-stream", daemon=True).start()
        # a ring puts a look into the queue: the one wait then covers both
        unsubscribe = self.alarm.subscribe(lambda: deliver((_LOOK, None))) if self.alarm is not None else None
        checked_at = float("-inf")
        try:
            while until is None or not until.is_set():
                if unsubscribe is None:
                    timeout = POLL_S
                else:
                    timeout = idle_wait_s() if idle_wait_s is not None else None
                try:
                    item, error = responses.get(timeout=timeout)
                except queue.Empty:
                    item = _LOOK
                if item is _LOOK:
                    if until is not None and until.is_set():
                        return  # a ring from ``stop``: the session has left
                    check()
                    checked_at = time.monotonic()
                    if idle is not None:
                        idle()
                    continue
                if item is _END:
                    if error is not None:
                        raise error
                    return
                if (now := time.monotonic()) - checked_at >= POLL_S:
                    check()
                    checked_at = now
                if not coalesce:
                    yield item
                    continue
                batch = [item]
                while (waiting := _get_nowait(responses)) is not None:
                    if waiting[0] is _LOOK:
                        check()
                        checked_at = time.monotonic()
                        continue
                    if waiting[0] is _END:
                        yield batch
                        if waiting[1] is not None:
                            raise waiting[1]
                        return
                    batch.append(waiting[0])
                yield batch
        finally:
            if unsubscribe is not None:
                unsubscribe()
            # What the stream still holds goes now, not with a traceback: an exception raised here references this
            # frame (and a queued one the reader's frame, whose cells reach the queue), so the locals and the queue
            # entries would form reference cycles with it, keeping the request's tensors (on a GPU, device memory)
            # until the cyclic collector's next full collection.
            with delivering:
                listening.clear()
                while _get_nowait(responses) is not None:
                    pass
            item = error = batch = waiting = None  # (for the traceback's sake: see above)


_END = object()  # a stream's end in _stream's queue
_LOOK = object()  # in _stream's queue: the alarm rang, check now


def _get_nowait(responses: queue.SimpleQueue) -> tuple[Any, BaseException | None] | None:
    try:
        return responses.get_nowait()
    except queue.Empty:
        return None


class _AudioWorker:
    """Consumes the talker's frame stream on its own thread and emits decoded audio chunks.

    It runs beside the thinker loop so that text keeps flowing to the talker while frames are
    decoded; errors are re-raised in the request's thread (``raise_error``, ``join``). A stream with a
    ``ChunkPacer`` is told every frame arrival, decode time and audio sent, and is looked at again while no
    frame comes (``frames(idle, idle_wait_s)``'s wake-ups: with an alarm only while the pacer holds frames not
    sent yet), so a stalled talker does not hold frames a listener needs. The session's ``alarm`` (if any) is rung
    when the worker ends with an error (the thinker loop's check then raises it at once, not at its next chunk) and
    by ``stop`` (the frame stream, asleep until a ring, then sees ``stopped``).
    """

    def __init__(self, frames: Callable[[Callable[[], None], Callable[[], float | None]], Iterator[torch.Tensor]],
                 clients: StageClients, stream: Code2WavStream, emit: Emit, stopped: threading.Event,
                 request_id: str = "", alarm: Alarm | None = None):
        self._pacer = getattr(stream, "pacer", None)  # a stand-in stream (tests) may have none
        # Session._stream: it raises on a cancel, the deadline or a dead talker
        self._frames = frames(self._on_idle, self._idle_wait_s)
        self._clients = clients
        self._stream = stream
        self._emit = emit
        self._error: BaseException | None = None
        self._stopped = stopped  # ``frames`` ends once it is set
        self._done = threading.Event()
        self._in_call = threading.Event()  # inside a code2wav call
        self._call_or_done = threading.Condition()  # notified when a code2wav call starts and when the worker ends
        self._alarm_rang = False  # (join, with an alarm) not looked at yet: looked at once inside a code2wav call
        self._alarm = alarm
        self._request_id = request_id  # for trace events only
        self._traced: set[str] = set()  # trace events cover the way to the first audio, once each
        self._thread = threading.Thread(target=self._run, name="talker-frames", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for frames in self._frames:  # ends early once stopped
                self._trace_once("session.talker_first_frames")
                if self._pacer is not None:
                    self._pacer.frames_arrived(frames.shape[0], time.monotonic())
                self._stream.append(frames)
                self._decode_due(final=False)
            if not self._stopped.is_set():
                self._decode_due(final=True)
        except BaseException as exc:  # surfaced in the request's thread
            self._error = exc
            if self._alarm is not None and not self._stopped.is_set():
                self._alarm.ring()
        finally:
            # a frame stream left early (a code2wav call failed) would keep buffering frames, and its frame holds
            # this worker (``_on_idle``): closed, it stops and lets go
            self._frames.close()
            if self._stopped.is_set():
                self._error = None  # the session has left and will not raise it (see ``stop``)
            with self._call_or_done:
                self._done.set()
                self._call_or_done.notify_all()

    def _decode_due(self, final: bool) -> None:
        while (job := self._stream.next_job(final=final)) is not None:
            self._trace_once("session.code2wav_first_call")
            started = time.monotonic()
            buffered_s = self._pacer.buffered_s(started) if self._pacer is not None else None
            urgent = self._pacer is not None and self._pacer.urgent(started)
            with self._call_or_done:
                self._in_call.set()
                self._call_or_done.notify_all()
            try:
                if self._stream.policy.stateful:
                    audio = self._clients.code2wav_stream(job.codes, first=job.start_frame == 0, urgent=urgent)
                else:
                    audio = self._clients.code2wav(job.codes, job.context_frames, urgent=urgent)
            finally:
                self._in_call.clear()
            if self._stopped.is_set():
                return  # the session ended while this call was blocked (a code2wav that died): say nothing
            now = time.monotonic()
            if trace.enabled():
                self._trace_chunk(job, buffered_s, urgent, started, now)
            if audio.numel():
                self._trace_once("session.code2wav_first_audio")
                self._emit("", audio)
            if self._pacer is not None:
                self._pacer.decode_took(now - started)
                self._pacer.audio_sent(job.new_frames * self._pacer.frame_s, now)

    def _trace_chunk(self, job: ChunkJob, buffered_s: float | None, urgent: bool, started: float,
                     ended: float) -> None:
        """A ``code2wav_chunk`` record per chunk (stamped when its audio came back): its new frames, why it has that
        many (``ChunkJob.reason``), the listener's buffer when it was sent (with a pacer), whether it went ahead
        as urgent, and the call's round trip, so a trace shows the sizes the code2wav stage is given and why."""
        trace.record("code2wav_chunk", ended, request=self._request_id, frames=job.new_frames,
                     context_frames=job.context_frames, reason=job.reason, call_ms=(ended - started) * 1e3,
                     buffered_ms=None if buffered_s is None else buffered_s * 1e3, urgent=urgent)

    def _on_idle(self) -> None:
        if self._pacer is not None and not self._stopped.is_set():
            self._decode_due(final=False)

    def _idle_wait_s(self) -> float | None:
        """How long the frame stream may sleep without a frame: a pacer holding frames not decoded yet may send them
        on time alone, so it is looked at every ``POLL_S``; otherwise only a frame or the alarm changes anything."""
        if self._pacer is not None and getattr(self._stream, "pending_frames", 1) > 0:
            return POLL_S
        return None

    def _trace_once(self, name: str) -> None:
        if trace.enabled() and name not in self._traced:
            self._traced.add(name)
            trace.event(self._request_id, name)

    def raise_error(self) -> None:
        """Raise the worker's error in the request's thread, once: raised, it ends the session. Kept, it would
        form a reference cycle (its traceback then holds the session's frames too, and they hold this worker)
        that keeps everything the request held, its tensors too, until the cyclic collector's next full
        collection: under load, device memory that grew with every failed, cancelled or expired request."""
        if self._error is None:
            return
        error, self._error = self._error, None
        try:
            raise error
        finally:
            del error  # nor does this frame, which the traceback holds, keep it

    def join(self, check: Callable[[], None], alarm: Alarm | None = None) -> None:
        """Wait for the last audio; ``check`` raises if the request must stop meanwhile. It is asked while the worker
        is inside a code2wav call (one to a stage that died never returns): every ``POLL_S``, or with ``alarm`` at
        each ring (and once at a call's start if one rang since the last look). Outside one the worker reads its
        frame stream, whose own checks (a cancel, the deadline, a dead talker or code2wav) end it with the error
        raised here, so this thread sleeps: a wake-up per stream every ``POLL_S`` was a good part of the
        orchestrator's CPU under load."""
        if alarm is not None:
            self._join_on_alarm(check, alarm)
            return
        while True:
            with self._call_or_done:
                self._call_or_done.wait_for(lambda: self._done.is_set() or self._in_call.is_set())
                if self._done.is_set():
                    break
                self._call_or_done.wait(POLL_S)  # a call's end is not notified: the next look tells
                in_call = self._in_call.is_set() and not self._done.is_set()
            if in_call:
                check()
        self.raise_error()

    def _join_on_alarm(self, check: Callable[[], None], alarm: Alarm) -> None:
        def rang() -> None:
            with self._call_or_done:
                self._alarm_rang = True
                self._call_or_done.notify_all()

        self._alarm_rang = True  # a ring before this subscription is not missed: the first call looks anyway
        unsubscribe = alarm.subscribe(rang)
        try:
            while True:
                with self._call_or_done:
                    self._call_or_done.wait_for(
                        lambda: self._done.is_set() or (self._alarm_rang and self._in_call.is_set()))
                    if self._done.is_set():
                        break
                    self._alarm_rang = False
                check()
        finally:
            unsubscribe()
        self.raise_error()

    def stop(self, timeout_s: float = 10.0, leave_call: bool = False) -> None:
        """End the worker before the session ends: past that, its checks would ask Triton whether a request is
        cancelled after its response sender is gone, which crashes the server (TRITONBACKEND_ResponseFactory-
        IsCancelled on a freed factory), and it could still emit. A worker blocked in a call to a dead stage
        is left behind: when that call returns it sees ``stopped`` and ends without a word. With ``leave_call``
        (code2wav died) one inside a code2wav call is left at once: that call ends only with Triton's verdict,
        1-3 s later, and after it the worker makes no check (an error ends it; a return sees ``stopped``, and
        the frame stream then ends on ``stopped`` before any check)."""
        self._stopped.set()
        if self._alarm is not None:
            self._alarm.ring()
        if leave_call and self._in_call.is_set():
            return  # the worker drops its own error once its call returns (``_run``)
        self._thread.join(timeout_s)
        self._error = None  # an error the session did not raise (it ended for its own reason): see raise_error
