"""One request's trip through thinker -> talker -> code2wav, independent of how stages are reached.

The Triton orchestrator (BLS calls) and the in-process pipeline (direct engine calls) both run this
class; they differ only in the ``StageClients`` they pass. Streaming mode overlaps everything:
text deltas leave as soon as the thinker produces them, every thinker chunk is forwarded to the
talker while the thinker keeps generating, and codec frames are decoded in small left-context
chunks as they arrive. Sequential mode runs each stage to completion before the next (the baseline).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from omni_triton.pipeline.code2wav_stream import Code2WavStream
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
    def code2wav(self, codes: torch.Tensor, left_context_frames: int) -> torch.Tensor:
        """codes [G, N] (left context first) -> the new samples only."""
    def abort(self, request_id: str) -> None: ...


class Cancelled(Exception):
    """The client went away; every stage was told to drop the request."""


@dataclass
class SessionParams:
    return_audio: bool
    sequential: bool


Emit = Callable[[str, torch.Tensor | None], None]  # (text delta, audio samples or None)


class Session:
    def __init__(self, request_id: str, params: SessionParams, clients: StageClients,
                 detokenizer: IncrementalDetokenizer, audio_stream_factory: Callable[[], Code2WavStream],
                 is_cancelled: Callable[[], bool] = lambda: False):
        self.request_id = request_id
        self.params = params
        self.clients = clients
        self.detokenizer = detokenizer
        self.audio_stream_factory = audio_stream_factory
        self.is_cancelled = is_cancelled

    def run(self, emit: Emit) -> None:
        """Stream the whole request through ``emit``; raises Cancelled if the client cancels."""
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
        try:
            for chunk in self.clients.thinker(self.request_id):
                self._check_cancelled()
                delta = self.detokenizer.push(chunk.token_ids)
                if chunk.finished:
                    delta += self.detokenizer.flush()
                if delta:
                    emit(delta, None)
                if not self.params.return_audio:
                    continue
                if audio_worker is None:
                    frames = self.clients.talker_start(self.request_id, chunk)
                    audio_worker = _AudioWorker(frames, self.clients, self.audio_stream_factory(), emit,
                                                self._check_cancelled)
                else:
                    self.clients.talker_append(self.request_id, chunk)
            if audio_worker is not None:
                audio_worker.join()
        finally:
            if audio_worker is not None:
                audio_worker.stop()

    # -- sequential (baseline) -------------------------------------------------------------------
    def _run_sequential(self, emit: Emit) -> None:
        chunks = []
        for chunk in self.clients.thinker(self.request_id):
            self._check_cancelled()
            chunks.append(chunk)
        token_ids = [t for c in chunks for t in c.token_ids]
        text = self.detokenizer.push(token_ids) + self.detokenizer.flush()
        if text:
            emit(text, None)
        if not self.params.return_audio or not chunks:
            return
        frames = self.clients.talker_start(self.request_id, chunks[0])
        for chunk in chunks[1:]:
            self.clients.talker_append(self.request_id, chunk)
        all_frames = [f for f in frames]
        self._check_cancelled()
        if all_frames:
            codes = torch.cat(all_frames, dim=0).T.contiguous()
            emit("", self.clients.code2wav(codes, 0))

    def _check_cancelled(self) -> None:
        if self.is_cancelled():
            raise Cancelled(self.request_id)


class _AudioWorker:
    """Consumes the talker's frame stream on its own thread and emits decoded audio chunks.

    It runs beside the thinker loop so that text keeps flowing to the talker while frames are
    decoded; errors are re-raised on ``join`` in the request's thread.
    """

    def __init__(self, frames: Iterator[torch.Tensor], clients: StageClients, stream: Code2WavStream, emit: Emit,
                 check_cancelled: Callable[[], None]):
        self._frames = frames
        self._clients = clients
        self._stream = stream
        self._emit = emit
        self._check_cancelled = check_cancelled
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._done = threading.Event()  # set when frames stop being used; the stream may still be draining
        self._thread = threading.Thread(target=self._run, name="talker-frames", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for frames in self._frames:
                if self._stopped.is_set():
                    break
                self._check_cancelled()
                self._stream.append(frames)
                self._decode_due(final=False)
            else:
                self._decode_due(final=True)
        except BaseException as exc:  # surfaced in join()
            self._error = exc
        finally:
            self._done.set()
            # Read the talker stream to its end (the abort that follows a failure or cancel closes it).
            # Left unread, its responses back up into the talker, whose sends then block: every other
            # stream stalled with it (seen under load after a code2wav error in one request).
            with contextlib.suppress(Exception):  # a late stage error changes nothing now
                for _ in self._frames:
                    pass

    def _decode_due(self, final: bool) -> None:
        while (job := self._stream.next_job(final=final)) is not None:
            audio = self._clients.code2wav(job.codes, job.context_frames)
            if audio.numel():
                self._emit("", audio)

    def join(self) -> None:
        self._done.wait()  # not the thread: after a failure it drains until the session's abort
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stopped.set()
