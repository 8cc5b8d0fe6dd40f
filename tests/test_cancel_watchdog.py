"""Event-driven waits of an orchestrator's sessions (CPU, no server): one watchdog thread asks Triton about every
running request and rings its session's alarm; a session with an alarm sleeps in its waits until it rings, and still
ends within a poll of a cancel, a deadline, a dead stage or a failed audio path."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from _session_helpers import DEATH, OneJob, word_detokenizer

from omni_triton.pipeline.alarm import Alarm
from omni_triton.pipeline.session import POLL_S, Cancelled, Session, SessionParams, StageFailed, ThinkerChunk
from omni_triton.stages.cancel_watchdog import CancelWatchdog


class FakeRequest:
    """Triton's request, as the watchdog sees it: whether the client cancelled, and how often it was asked."""

    def __init__(self):
        self.cancelled = False
        self.asked = 0

    def is_cancelled(self):
        self.asked += 1
        return self.cancelled


def rung_within(alarm: Alarm, seconds: float) -> float | None:
    """Seconds until ``alarm`` rings (None: not within ``seconds``)."""
    rang = threading.Event()
    unsubscribe = alarm.subscribe(rang.set)
    started = time.monotonic()
    try:
        return time.monotonic() - started if rang.wait(seconds) else None
    finally:
        unsubscribe()


@pytest.fixture
def watchdog():
    dog = CancelWatchdog()
    yield dog
    dog.stop()


def test_a_triton_cancel_sets_the_flag_and_rings_within_a_poll(watchdog):
    request, cancelled, alarm = FakeRequest(), threading.Event(), Alarm()
    watchdog.watch("r", request, cancelled, math.inf, alarm)
    assert rung_within(alarm, 3 * POLL_S) is None, "nothing happened: no ring"
    request.cancelled = True
    assert rung_within(alarm, 3 * POLL_S) is not None
    assert cancelled.is_set(), "the session's check reads the flag, not Triton"


def test_a_control_cancel_and_a_deadline_ring_without_asking_triton_again(watchdog):
    flagged, expiring = FakeRequest(), FakeRequest()
    flag, flag_alarm, deadline_alarm = threading.Event(), Alarm(), Alarm()
    watchdog.watch("flagged", flagged, flag, math.inf, flag_alarm)
    watchdog.watch("expiring", expiring, threading.Event(), time.monotonic() + POLL_S, deadline_alarm)
    flag.set()
    assert rung_within(flag_alarm, 3 * POLL_S) is not None
    assert rung_within(deadline_alarm, 4 * POLL_S) is not None
    asked = flagged.asked, expiring.asked
    time.sleep(3 * POLL_S)
    assert (flagged.asked, expiring.asked) == asked, "an ended request is not asked again"


def test_an_unwatched_request_is_never_asked_again_and_an_idle_watchdog_asks_nothing(watchdog):
    request = FakeRequest()
    watchdog.watch("r", request, threading.Event(), math.inf, Alarm())
    time.sleep(3 * POLL_S)
    assert request.asked >= 1
    watchdog.unwatch("r")
    asked = request.asked
    time.sleep(3 * POLL_S)
    assert request.asked == asked, "past its final response Triton must not be asked about it (server crash)"


def test_ring_all_rings_every_running_session(watchdog):
    alarms = [Alarm() for _ in range(3)]
    for index, alarm in enumerate(alarms):
        watchdog.watch(str(index), FakeRequest(), threading.Event(), math.inf, alarm)
    rang = []
    for alarm in alarms:
        alarm.subscribe(lambda: rang.append(1))
    watchdog.ring_all()
    assert len(rang) == 3


# -- a session with an alarm -----------------------------------------------------------------------------------
class StalledStages:
    """A thinker that sends one chunk (then, with ``thinker_sends_more``, nothing until released); a talker with one
    frame (then, with ``talker_stalls``, nothing until released); a code2wav call that blocks until released
    (``code2wav_blocks``), fails at once, or (``code2wav_returns``) returns."""

    def __init__(self, code2wav_blocks: bool = True):
        self.release, self.in_code2wav = threading.Event(), threading.Event()
        self.code2wav_blocks = code2wav_blocks
        self.code2wav_returns = False
        self.thinker_sends_more = False
        self.talker_stalls = False

    def thinker(self, request_id):
        yield ThinkerChunk([1], not self.thinker_sends_more)
        if self.thinker_sends_more:
            self.release.wait(30)
            yield ThinkerChunk([2], True)

    def talker_start(self, request_id, chunk):
        yield torch.zeros(1, 4, dtype=torch.long)
        if self.talker_stalls:
            self.release.wait(30)

    def talker_append(self, request_id, chunk):
        pass

    def merge_payloads(self, payloads):
        return None

    def code2wav(self, codes, left_context_frames, urgent=False):
        self.in_code2wav.set()
        if self.code2wav_returns:
            return torch.zeros(4)
        if not self.code2wav_blocks:
            raise RuntimeError("code2wav refused the chunk")
        assert self.release.wait(30), "the test releases every blocked call"
        return torch.zeros(4)

    def abort(self, request_id):
        pass


def session_of(stages, alarm, is_cancelled=lambda: False, stage_failure=lambda stage: None):
    return Session("r", SessionParams(return_audio=True, sequential=False), stages, word_detokenizer(), OneJob,
                   is_cancelled=is_cancelled, stage_failure=stage_failure, alarm=alarm)


def run_in_thread(session):
    outcome: list[BaseException | None] = []

    def run():
        try:
            session.run(lambda text, audio: None)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_waiting_session_checks_nothing_until_its_alarm_rings_then_ends_at_once():
    stages, alarm, cancelled, asked = StalledStages(), Alarm(), threading.Event(), []
    stages.thinker_sends_more = stages.talker_stalls = stages.code2wav_returns = True

    def is_cancelled():
        asked.append(time.monotonic())
        return cancelled.is_set()

    thread, outcome = run_in_thread(session_of(stages, alarm, is_cancelled))
    try:
        assert stages.in_code2wav.wait(5)
        time.sleep(5 * POLL_S)
        settled = len(asked)
        time.sleep(5 * POLL_S)
        assert len(asked) == settled, "no polling: the waits sleep until something happens"
        cancelled.set()
        rung_at = time.monotonic()
        alarm.ring()
        thread.join(1.0)
        assert outcome and isinstance(outcome[0], Cancelled)
        assert time.monotonic() - rung_at < 0.5
    finally:
        stages.release.set()


def test_a_ring_inside_a_blocked_code2wav_call_ends_the_request_when_the_stage_died():
    stages, alarm, dead = StalledStages(), Alarm(), threading.Event()
    thread, outcome = run_in_thread(session_of(
        stages, alarm, stage_failure=lambda stage: DEATH if stage == "code2wav" and dead.is_set() else None))
    try:
        assert stages.in_code2wav.wait(5)  # the thinker ended: the request thread waits in join
        time.sleep(2 * POLL_S)
        assert not outcome
        dead.set()
        alarm.ring()  # the stage supervisor's broadcast
        thread.join(1.0)
        assert outcome and isinstance(outcome[0], StageFailed)
    finally:
        stages.release.set()


def test_a_failed_audio_path_ends_the_request_while_the_thinker_is_silent():
    stages, alarm = StalledStages(code2wav_blocks=False), Alarm()
    stages.thinker_sends_more = True
    thread, outcome = run_in_thread(session_of(stages, alarm))
    try:
        thread.join(1.0)
        assert outcome and isinstance(outcome[0], RuntimeError) and "refused the chunk" in str(outcome[0])
    finally:
        stages.release.set()
