"""A code2wav stage that dies while the thinker still streams (found by the soak's killed code2wav, bench --soak
kill): the request must fail then, not when its text has ended, and not only when the call blocked on the dead
stage returns (Triton's "Stub process ... is not healthy", 1-3 s later): the session ends at once and leaves the
blocked worker behind."""

from __future__ import annotations

import threading

import pytest
import torch
from _session_helpers import DEATH, OneJob, word_detokenizer

from omni_triton.pipeline.session import Session, SessionParams, StageFailed, ThinkerChunk

CHUNKS = 3000  # the thinker's chunks, one token each: far more than the session reads once code2wav died


class DeadCode2Wav:
    """Thinker chunks until told to stop (or CHUNKS), one frame from the talker, and a code2wav whose call blocks
    as one to a dead stub does until Triton's verdict (here: until the test releases it)."""

    def __init__(self):
        self.dead, self.release, self.thinker_done = threading.Event(), threading.Event(), threading.Event()
        self.read = 0

    def thinker(self, request_id):
        for index in range(CHUNKS):
            self.read = index
            if self.release.wait(0.002):  # >= 6 s of chunks in all
                break
            yield ThinkerChunk([index % 4], index == CHUNKS - 1)
        self.thinker_done.set()

    def talker_start(self, request_id, chunk):
        return iter([torch.zeros(1, 4, dtype=torch.long)])

    def talker_append(self, request_id, chunk):
        pass

    def merge_payloads(self, payloads):  # chunks that queued behind an append go as one
        return None

    def code2wav(self, codes, left_context_frames, urgent=False):
        self.dead.set()  # the stage dies under this call
        assert self.release.wait(30), "the test releases every blocked call"
        raise RuntimeError("Stub process 'code2wav_0_0' is not healthy.")

    def abort(self, request_id):
        pass


def test_a_dead_code2wav_fails_the_request_while_the_thinker_streams():
    clients = DeadCode2Wav()
    session = Session("r", SessionParams(return_audio=True, sequential=False), clients, word_detokenizer(), OneJob,
                      stage_failure=lambda stage: DEATH if stage == "code2wav" and clients.dead.is_set() else None)
    try:
        with pytest.raises(StageFailed, match="code2wav stage failed"):
            session.run(lambda text, audio: None)
        assert not clients.release.is_set() and not clients.thinker_done.is_set(), \
            "the request failed while the thinker streamed and the code2wav call was still blocked"
    finally:
        clients.release.set()
