"""A session lets go of everything its request held as soon as it ends, whatever the end: completed, cancelled
while its audio plays or while the thinker still streams, past its deadline, or failed in a stage. Freed by
reference counting alone, not by Python's cyclic collector: a reference cycle (an exception kept by the audio
worker, whose traceback holds the session's frames) kept a request's tensors until the collector's next full
collection, and on a GPU the orchestrator's device memory grew with every request that ended that way (issue 48's
soak). So the collector is off while each case runs, and every tensor a stage handed the session must be gone."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from omni_triton.graph_buckets import collector_paused
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy, Code2WavStream
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer
from omni_triton.pipeline.session import Cancelled, Session, SessionParams, ThinkerChunk
from omni_triton.stages.bls_clients import StageError
from test_session_coalescing import word_tokenizer

QUANTIZERS = 4
STREAM_THREADS = ("thinker-stream", "talker-stream", "talker-frames")


class TensorStages:
    """Thinker, talker and code2wav that hand out tensors (each remembered by a weak reference) and stream until
    their request is aborted or their end. ``thinker_chunks``, ``frames``: how many chunks the thinker streams, frames
    the talker; ``fail``: the stage whose stream or call fails ("talker": its frame stream after 3 frames,
    "code2wav": its second call)."""

    def __init__(self, thinker_chunks: int, frames: int, fail: str | None = None):
        self.thinker_chunks, self.frames, self.fail = thinker_chunks, frames, fail
        self.playing = threading.Event()  # the first audio went out
        self.aborted = threading.Event()
        self.made: list[weakref.ref] = []
        self._code2wav_calls = 0

    def tensor(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        tensor = torch.zeros(*shape, dtype=dtype)
        self.made.append(weakref.ref(tensor))
        return tensor

    def alive(self) -> int:
        """How many of the tensors made (and the session and audio stream ``run_session`` adds) are still alive."""
        return sum(ref() is not None for ref in self.made)

    def thinker(self, request_id):
        for i in range(self.thinker_chunks):
            if self.aborted.is_set():
                return
            yield ThinkerChunk([i % 40], i == self.thinker_chunks - 1, payload={"HIDDEN": self.tensor(2, 8)})
            time.sleep(0.001)

    def talker_start(self, request_id, chunk):
        return self._frames()

    def _frames(self):
        for i in range(self.frames):
            if self.aborted.is_set():
                return
            if self.fail == "talker" and i == 3:
                raise StageError("talker: boom")
            yield self.tensor(1, QUANTIZERS, dtype=torch.long)
            time.sleep(0.001)

    def talker_append(self, request_id, chunk):
        pass

    def merge_payloads(self, payloads):
        return {"HIDDEN": torch.cat([payload["HIDDEN"] for payload in payloads])}

    def code2wav(self, codes, left_context_frames, urgent=False):
        self._code2wav_calls += 1
        if self.fail == "code2wav" and self._code2wav_calls == 2:
            raise StageError("code2wav: boom")
        return self.tensor(codes.shape[-1] * 8)

    def code2wav_close(self):
        pass

    def abort(self, request_id):
        self.aborted.set()


@pytest.fixture
def no_cyclic_collector():
    with collector_paused():
        yield


def run_session(stages: TensorStages, is_cancelled) -> str:
    def emit(text, audio):
        if audio is not None:
            stages.playing.set()

    def audio_stream() -> Code2WavStream:  # it holds the request's codes (on a GPU, device memory) too
        stream = Code2WavStream(ChunkPolicy().resolved(2), QUANTIZERS)
        stages.made.append(weakref.ref(stream))
        return stream

    session = Session("req", SessionParams(return_audio=True, sequential=False), stages,
                      IncrementalDetokenizer(word_tokenizer()), audio_stream, is_cancelled=is_cancelled)
    stages.made.append(weakref.ref(session))
    try:
        session.run(emit)
        return "completed"
    except Cancelled:
        return "cancelled"
    except StageError:
        return "failed"


def join_stream_threads(before: set[threading.Thread], timeout_s: float = 30.0) -> None:
    """The session's reader threads (started since ``before``) read their stage streams to the end after it returns
    (see Session._stream); the audio worker ends with it."""
    for thread in set(threading.enumerate()) - before:
        if thread.name in STREAM_THREADS:
            thread.join(timeout_s)
            assert not thread.is_alive(), f"{thread.name} never ended"


def deadline_after_first_audio(stages: TensorStages):
    """Like the orchestrator's deadline: past it (here: a moment after the first audio went out) the request
    counts as cancelled."""
    deadline = [None]

    def past() -> bool:
        if deadline[0] is None and stages.playing.is_set():
            deadline[0] = time.monotonic() + 0.01
        return deadline[0] is not None and time.monotonic() > deadline[0]

    return past


LONG = 5000  # frames of an answer that ends when aborted, long before its end
CASES = {
    # name: (thinker chunks, talker frames, failing stage, is_cancelled(stages), how it ends)
    "completed": (12, 40, None, lambda stages: lambda: False, "completed"),
    # the thinker is done: the audio worker's frame stream sees the cancel, and its error ends the session
    "cancelled while the audio plays": (3, LONG, None, lambda stages: stages.playing.is_set, "cancelled"),
    # the thinker still streams: the session's own check sees it, the worker's error is left unraised
    "cancelled while the thinker streams": (100_000, LONG, None, lambda stages: stages.playing.is_set, "cancelled"),
    "past its deadline": (3, LONG, None, deadline_after_first_audio, "cancelled"),
    "talker stream failed": (3, LONG, "talker", lambda stages: lambda: False, "failed"),
    "code2wav call failed": (3, LONG, "code2wav", lambda stages: lambda: False, "failed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_session_frees_its_requests_tensors_without_the_cyclic_collector(case, no_cyclic_collector):
    chunks, frames, fail, is_cancelled, ends = CASES[case]
    stages = TensorStages(chunks, frames, fail)
    before = set(threading.enumerate())
    assert run_session(stages, is_cancelled(stages)) == ends
    join_stream_threads(before)
    assert stages.made, "the stages handed out no tensors: the case tests nothing"
    assert stages.alive() == 0, (f"{stages.alive()} of {len(stages.made)} tensors (the session and its audio stream "
                                 "among them) still held after the request ended")
