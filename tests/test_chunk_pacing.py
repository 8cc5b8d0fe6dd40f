"""ChunkPacer against simulated talkers: steady fast, just above real time, below it, bursty, stalled.

A discrete-event model of ``session._AudioWorker``: it wakes at every frame arrival, or ``poll_s`` after its
last wake-up when none comes, asks the stream for due chunks, and each decode call blocks it for ``decode_s``
(frames that come meanwhile wait). What a listener hears is measured with the bench's own ``dry_time``.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_triton import trace
from omni_triton.bench.metrics import dry_time
from omni_triton.pipeline.code2wav.pacing import FRAME_S, ChunkPacer
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy, Code2WavStream
from omni_triton.pipeline.session import Session, SessionParams, ThinkerChunk

POLICY = ChunkPolicy(first_chunk_frames=4, chunk_frames=25, left_context_frames=25)
POLL_S = 0.05
RATE = 24000


class FixedRamp:
    """The ramp alone (Code2WavStream without a pacer), for comparison."""

    def __init__(self, policy: ChunkPolicy):
        self.policy = policy

    def chunk_size(self, decoded, pending, now):
        return self.policy.chunk_size(decoded)

    def frames_arrived(self, count, now): pass
    def decode_took(self, seconds): pass
    def audio_sent(self, seconds, now): pass


def simulate(pacer, arrivals: list[tuple[float, int]], decode_s: float) -> list[tuple[float, int]]:
    """arrivals: (time, frames) in time order -> the chunks sent: (time, new frames)."""
    sent, now, decoded, pending, index = [], 0.0, 0, 0, 0

    def decode_due(final: bool) -> None:
        nonlocal now, decoded, pending
        while True:
            want = pacer.chunk_size(decoded, pending, now)
            new = min(want, pending)
            if new == 0 or (new < want and not final):
                return
            now += decode_s
            sent.append((now, new))
            decoded, pending = decoded + new, pending - new
            pacer.decode_took(decode_s)
            pacer.audio_sent(new * FRAME_S, now)

    while index < len(arrivals):
        arrival, count = arrivals[index]
        if arrival <= now + POLL_S:  # a frame wakes the worker (at once, if it came while it was decoding)
            now = max(now, arrival)
            pacer.frames_arrived(count, now)
            pending += count
            index += 1
        else:
            now += POLL_S  # the idle wake-up
        decode_due(final=False)
    decode_due(final=True)  # the talker's stream ended
    assert decoded == sum(count for _, count in arrivals)
    return sent


def steady(frames_per_s: float, frames: int, start: float = 0.2) -> list[tuple[float, int]]:
    return [(start + i / frames_per_s, 1) for i in range(frames)]


def heard_dry_s(sent: list[tuple[float, int]]) -> float:
    return dry_time([(t, round(n * FRAME_S * RATE)) for t, n in sent], RATE)


REAL_TIME = 1 / FRAME_S  # 12.5 frames per second


def test_fast_stream_never_runs_dry_and_uses_few_large_chunks():
    sent = simulate(ChunkPacer(POLICY), steady(8 * REAL_TIME, 250), decode_s=0.02)
    assert heard_dry_s(sent) == 0
    assert [n for _, n in sent][:3] == [4, 8, 24]  # the ramp is the start
    assert len(sent) <= math.ceil(250 / POLICY.chunk_frames) + 2
    assert len(sent) == len(simulate(FixedRamp(POLICY), steady(8 * REAL_TIME, 250), decode_s=0.02))


def test_just_above_real_time_the_ramp_runs_dry_and_the_pacer_does_not():
    arrivals = steady(1.1 * REAL_TIME, 250)
    assert heard_dry_s(simulate(FixedRamp(POLICY), arrivals, decode_s=0.05)) > 0.3
    sent = simulate(ChunkPacer(POLICY), arrivals, decode_s=0.05)
    assert heard_dry_s(sent) == 0
    assert max(n for _, n in sent) >= 20  # the buffer grows, and chunks with it


def test_below_real_time_the_silence_is_what_the_talker_forces_and_chunks_stay_rebuffer_sized():
    arrivals, decode_s = steady(0.8 * REAL_TIME, 150), 0.03
    sent = simulate(ChunkPacer(POLICY), arrivals, decode_s)
    # No pacing can play frame k before it arrived and was decoded: the least dry time after this first chunk.
    first = sent[0][0]
    least = max(arrival + decode_s - first - k * FRAME_S for k, (arrival, _) in enumerate(arrivals))
    dry = heard_dry_s(sent)
    assert least > 1.0 and least - 1e-9 <= dry <= least + POLICY.first_chunk_frames / (0.8 * REAL_TIME)
    assert len(sent) <= 150 / POLICY.first_chunk_frames + 2  # a dry listener rebuffers, no one-frame calls


def test_bursty_stream_above_real_time_on_average_never_runs_dry():
    # 10 frames (0.8 s of audio) at once every 0.7 s: 1.14x real time with long pauses between bursts
    arrivals = [(0.2 + 0.7 * burst, 10) for burst in range(25)]
    assert heard_dry_s(simulate(FixedRamp(POLICY), arrivals, decode_s=0.04)) > 0
    assert heard_dry_s(simulate(ChunkPacer(POLICY), arrivals, decode_s=0.04)) == 0


def test_a_stalled_talker_does_not_hold_frames_the_listener_needs():
    # 20 frames fast, then nothing for 3 s: the pending frames go out before the buffer drains, not at the end
    arrivals = steady(5 * REAL_TIME, 20) + [(4.0, 1)]
    sent = simulate(ChunkPacer(POLICY), arrivals, decode_s=0.02)
    assert sum(n for t, n in sent if t < 4.0) == 20
    ramp = simulate(FixedRamp(POLICY), arrivals, decode_s=0.02)
    assert sum(n for t, n in ramp if t < 4.0) == 12  # 4 + 8: the 24-frame chunk waits for the stall to end


@settings(max_examples=60, deadline=None)
@given(speed=st.floats(1.1, 20.0), decode_s=st.floats(0.002, 0.08), frames=st.integers(5, 300),
       jitter=st.lists(st.floats(0.0, 1.0), min_size=300, max_size=300))
def test_no_underrun_while_the_frame_rate_stays_above_real_time(speed, decode_s, frames, jitter):
    """Any steady rate >= 1.1x real time with arrival jitter up to half a frame interval, any decode time up to
    80 ms (the margin covers it): the listener never waits."""
    interval = 1 / (speed * REAL_TIME)
    arrivals = [(0.2 + (i + 0.5 * jitter[i]) * interval, 1) for i in range(frames)]
    sent = simulate(ChunkPacer(POLICY), arrivals, decode_s)
    assert heard_dry_s(sent) == pytest.approx(0, abs=1e-9)


def test_pacer_reads_the_listeners_buffer_as_a_player_that_pauses():
    pacer = ChunkPacer(POLICY)
    assert pacer.buffered_s(1.0) == 0
    pacer.audio_sent(0.32, now=1.0)
    assert pacer.buffered_s(1.1) == pytest.approx(0.22)
    assert pacer.buffered_s(2.0) == 0                    # dry since 1.32
    pacer.audio_sent(1.0, now=2.0)                       # playback resumes at 2.0, not at 1.32
    assert pacer.buffered_s(2.5) == pytest.approx(0.5)
    assert pacer.decode_s() == pacer.decode_prior_s
    pacer.decode_took(0.03)
    pacer.decode_took(0.07)
    assert pacer.decode_s() == 0.07 and pacer.next_frame_wait_s() == FRAME_S


def test_a_chunk_is_urgent_while_its_listener_has_under_urgent_s_left():
    pacer = ChunkPacer(POLICY)
    assert pacer.urgent_s == 0.5
    assert not pacer.urgent(1.0)                         # nothing sent: the first chunk has its own priority
    pacer.audio_sent(0.32, now=1.0)
    assert pacer.urgent(1.0)                             # 0.32 s left
    pacer.audio_sent(0.64, now=1.1)                      # 0.86 s left
    assert not pacer.urgent(1.1)
    assert not pacer.urgent(1.45) and pacer.urgent(1.47)  # the 0.5 s line is crossed at 1.46
    assert pacer.urgent(5.0)                             # dry
    assert not ChunkPacer(POLICY, urgent_s=0).urgent(1.0)


def test_pacer_rejects_nonsense_settings():
    with pytest.raises(ValueError, match="poll_s"):
        ChunkPacer(POLICY, poll_s=0)
    with pytest.raises(ValueError, match="urgent_s"):
        ChunkPacer(POLICY, urgent_s=-1)


# -- the session's audio worker: a stalled talker is looked at again ------------------------------------

class _SilentText:
    def push(self, token_ids):
        return ""

    def flush(self):
        return ""


class _StallingTalker:
    """StageClients whose talker sends 4 frames, then 3, then stalls until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.urgent: list[bool] = []  # per code2wav call, whether the session sent it ahead

    def thinker(self, request_id):
        yield ThinkerChunk([1], finished=True)

    def talker_start(self, request_id, chunk):
        yield torch.zeros(4, 2, dtype=torch.long)
        yield torch.zeros(3, 2, dtype=torch.long)
        assert self.release.wait(30), "the test never released the talker"

    def talker_append(self, request_id, chunk):
        pass

    def code2wav(self, codes, left_context_frames, urgent=False):
        self.urgent.append(urgent)
        return torch.zeros((codes.shape[1] - left_context_frames) * 10)

    def abort(self, request_id):
        pass


@pytest.mark.parametrize("paced", [True, False])
def test_a_paced_stream_decodes_frames_a_stalled_talker_left_pending(paced, traced):
    clients = _StallingTalker()
    policy = ChunkPolicy(first_chunk_frames=4, chunk_frames=25, left_context_frames=2)
    chunks, second_chunk = [], threading.Event()

    def emit(text, audio):
        if audio is not None:
            chunks.append(audio.numel() // 10)
            if len(chunks) == 2:
                second_chunk.set()

    session = Session("r", SessionParams(return_audio=True, sequential=False), clients, _SilentText(),
                      lambda: Code2WavStream(policy, 2, ChunkPacer(policy) if paced else None))
    runner = threading.Thread(target=session.run, args=(emit,))
    runner.start()
    # paced: the 3 frames go out before the first chunk's 320 ms have played; the ramp waits for 8 frames
    got_second = second_chunk.wait(5.0 if paced else 1.0)
    clients.release.set()
    runner.join(30)
    assert got_second == paced
    assert chunks == [4, 3]
    # traced: one record per chunk, saying why it has that size (the pacer's deadline, or the stream's end)
    records = trace.read_records(traced, "code2wav_chunk")
    assert [(r["request"], r["frames"], r["reason"]) for r in records] == [
        ("r", 4, "first"), ("r", 3, "deadline" if paced else "final")]
    assert all(r["call_ms"] >= 0 for r in records)
    # the listener's buffer when each chunk went out: nothing before the first; only a pacer tracks it
    assert [r["buffered_ms"] is not None for r in records] == [paced, paced]
    assert not paced or records[0]["buffered_ms"] == 0 <= records[1]["buffered_ms"] <= 320
    # the chunk its deadline sent has under half a second left for its listener: it goes ahead of queued chunks
    # (the first has a priority of its own); without a pacer nothing is known of the listener
    assert clients.urgent == [False, paced]
    assert [r["urgent"] for r in records] == [False, paced]


@given(st.lists(st.tuples(st.floats(0.001, 0.5), st.integers(0, 5)), max_size=40), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_frames_per_s_kept_as_frames_come_is_the_rate_summed_afresh(arrivals, history):
    """The running frame count of recent arrivals (kept as they come and go) gives the rate a sum over them would."""
    pacer = ChunkPacer(POLICY, history=history)
    now = 0.0
    for gap, count in arrivals:
        now += gap
        pacer.frames_arrived(count, now)
        recent = list(pacer._arrivals)
        expected = (None if len(recent) < 2 or recent[-1][0] <= recent[0][0]
                    else sum(frames for _, frames in recent[1:]) / (recent[-1][0] - recent[0][0]))
        assert pacer.frames_per_s() == expected
