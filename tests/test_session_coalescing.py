"""The session forwards thinker chunks that queued while it was busy (an append is a round trip to the talker)
as one append, rows in order; and the merge of thinker outputs that makes that append."""

from __future__ import annotations

import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer
from omni_triton.pipeline.session import Session, SessionParams, ThinkerChunk
from omni_triton.pipeline.thinker_service import ThinkerOutput, merge_appends

WORDS = [f"w{i}" for i in range(40)]


def word_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


class SlowAppendClients:
    """A thinker that streams ``chunks`` chunks of one token, and a talker that records what it is appended and
    streams no frames, in lockstep: chunk 0 alone, then chunk 1 once the talker started, then all the rest while
    the first append is still in its round trip, so that they are all waiting when the session next reads."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.started, self.appending, self.all_sent = threading.Event(), threading.Event(), threading.Event()
        self.appends: list[ThinkerChunk] = []
        self.started_with: ThinkerChunk | None = None

    def thinker(self, request_id):
        for i in range(self.chunks):
            if i == 1:
                assert self.started.wait(10)
            if i == 2:
                assert self.appending.wait(10)
            yield ThinkerChunk([i], i == self.chunks - 1, payload=[i])
        self.all_sent.set()

    def talker_start(self, request_id, chunk):
        self.started_with = chunk
        self.started.set()
        return iter(())

    def talker_append(self, request_id, chunk):
        if not self.appends:
            self.appending.set()
            assert self.all_sent.wait(10)
        self.appends.append(chunk)

    def merge_payloads(self, payloads):
        return [row for payload in payloads for row in payload]

    def code2wav(self, codes, left_context_frames, urgent=False):
        raise AssertionError("no frames, no audio")

    def abort(self, request_id):
        pass


class NoAudio:
    policy = ChunkPolicy()  # left context, not stateful: the session closes no vocoder stream

    def append(self, frames):
        raise AssertionError("no frames")

    def next_job(self, final):
        return None


@pytest.mark.parametrize("chunks", [2, 3, 12])
def test_chunks_that_queued_behind_an_append_go_as_one_append_in_order(chunks):
    clients = SlowAppendClients(chunks)
    texts = []
    session = Session("r", SessionParams(return_audio=True, sequential=False), clients,
                      IncrementalDetokenizer(word_tokenizer()), NoAudio)
    session.run(lambda text, audio: texts.append(text))
    appended = [token for chunk in clients.appends for token in chunk.token_ids]
    assert clients.started_with.token_ids == [0]
    assert appended == list(range(1, chunks)), "every chunk past the first, once, in order"
    assert [row for chunk in clients.appends for row in chunk.payload] == list(range(1, chunks))
    assert len(clients.appends) == min(2, chunks - 1), "the chunks that waited went as one append"
    assert clients.appends[-1].finished and not any(chunk.finished for chunk in clients.appends[:-1])
    assert "".join(texts).split() == WORDS[:chunks], "one text delta per coalesced chunk, none lost"


def test_merge_appends_concatenates_rows_in_order_and_keeps_the_last_finished_flag():
    def output(first_id: int, rows: int, finished: bool) -> ThinkerOutput:
        ids = torch.arange(first_id, first_id + rows)
        return ThinkerOutput(ids, ids, ids[:, None].float().expand(rows, 4), torch.zeros(0, 4), 0, finished)

    merged = merge_appends([output(5, 1, False), output(6, 2, False), output(8, 1, True)])
    assert merged.token_ids.tolist() == merged.row_ids.tolist() == [5, 6, 7, 8]
    assert merged.embeds[:, 0].tolist() == [5.0, 6.0, 7.0, 8.0] and merged.hidden.shape == (0, 4)
    assert merged.prompt_len == 0 and merged.finished
    with pytest.raises(ValueError, match="past the first"):
        merge_appends([ThinkerOutput(torch.tensor([1]), torch.tensor([1]), torch.zeros(1, 4), torch.zeros(1, 4),
                                     1, False)])


def test_concat_rows_keeps_the_device_of_the_non_empty_rows():
    """A finishing chunk's rows are empty and arrive from host memory beside GPU rows (stage_io.from_torch):
    the merge keeps the rows where they are. 'meta' stands in for the GPU here: like CUDA, torch.cat refuses to
    mix it with host tensors."""
    from omni_triton.stages.stage_io import concat_rows

    gpu_rows = [torch.empty(2, 4, device="meta"), torch.empty(1, 4, device="meta")]
    merged = concat_rows([gpu_rows[0], torch.zeros(0, 4), gpu_rows[1]])
    assert merged.device.type == "meta" and merged.shape == (3, 4)
    with pytest.raises(RuntimeError):
        torch.cat([gpu_rows[0], torch.zeros(0, 4)])  # what the merge did before
    assert concat_rows([torch.zeros(0, 4), torch.zeros(0, 4)]).shape == (0, 4)
    assert torch.equal(concat_rows([torch.arange(2), torch.arange(2, 3)]), torch.arange(3))
