"""Admission by real-time capacity (omni_triton/stages/admission.py): the capacity estimate and the queue."""

from __future__ import annotations

import pytest

from omni_triton import cli
from omni_triton.stages.admission import FRAME_S, Admission, RealtimeCapacity, split_limit
from omni_triton.stages.queue_drain import Occupancy, QueueDrain, RecentMean
from omni_triton.shared.settings import LaunchConfig, admission_capacity_setting


def talker(step_s, streams: int, seconds: float = 1.0) -> tuple[int, int, float]:
    """What the orchestrator sees in ``seconds`` when each frame step of ``streams`` streams takes step_s(b)."""
    return streams, round(streams * seconds / step_s(streams)), seconds


def test_capacity_learns_a_slower_server_than_its_prior_and_stops_admitting_at_real_time():
    capacity = RealtimeCapacity()
    assert capacity.admits(32)  # the prior (an H200): ~10 ms per step at 32 streams is 8x real time
    slow = lambda b: 0.02 + 0.004 * b  # noqa: E731 -- real time (80 ms a step) at b = 15
    for streams in (1, 2, 4, 8, 12):
        for _ in range(10):
            capacity.observe(*talker(slow, streams))
    assert capacity.step_s(12) == pytest.approx(slow(12), rel=0.1)
    running = next(b for b in range(64) if not capacity.admits(b))
    # b + 1 streams must each get 1.1x real time: step <= 80 ms / 1.1 at b + 1 -> b + 1 <= 13.2
    assert running in (12, 13), running
    assert capacity.audio_s_per_s(13) == pytest.approx(13 / slow(13) * FRAME_S, rel=0.1)


def test_capacity_never_assumes_more_streams_are_cheaper():
    capacity = RealtimeCapacity(prior=(0.01, 0.0))
    capacity.observe(1, 100, 1.0)   # 10 ms a step at 1 stream
    capacity.observe(8, 400, 1.0)   # 20 ms at 8
    assert capacity.step_s(64) >= capacity.step_s(8) >= capacity.step_s(1) > 0


def test_an_instance_of_two_learns_and_admits_in_the_pipelines_streams():
    """--instances orchestrator=2: each instance sees half the pipeline's streams; its estimate is the pipeline's."""
    whole, half = RealtimeCapacity(), RealtimeCapacity(share=2)
    slow = lambda b: 0.02 + 0.004 * b  # noqa: E731 -- real time (80 ms a step) at b = 15
    for streams in (1, 2, 4, 6):
        for _ in range(10):
            seen = talker(slow, 2 * streams)
            whole.observe(*seen)
            # the half instance gets the same frames per stream over its half of the streams
            half.observe(streams, seen[1] // 2, seen[2], batch=streams)
    assert half.step_s(12) == pytest.approx(whole.step_s(12), rel=0.02)
    assert [half.admits(running) for running in range(10)] == [whole.admits(2 * r + 1) for r in range(10)]
    assert not half.admits(7)  # 16 streams on the pipeline: past real time
    assert half.instance_audio_s_per_s(4) == pytest.approx(whole.audio_s_per_s(8) / 2, rel=0.02)
    forced = RealtimeCapacity(forced_audio_s_per_s=4.5, share=2)  # the pipeline's 4.5: two streams per instance
    assert forced.admits(1) and not forced.admits(2) and forced.instance_audio_s_per_s(1) == 2.25
    with pytest.raises(ValueError, match="share must be >= 1"):
        RealtimeCapacity(share=0)


def test_forced_capacity_counts_streams_at_real_time():
    capacity = RealtimeCapacity(forced_audio_s_per_s=2.5)
    capacity.observe(1, 1, 100.0)  # ignored: the number is fixed
    assert capacity.admits(0) and capacity.admits(1) and not capacity.admits(2)  # 3 x 1.1 > 2.5
    with pytest.raises(ValueError, match="capacity"):
        RealtimeCapacity(forced_audio_s_per_s=0)


def test_requests_past_capacity_wait_in_order_and_past_the_queue_are_refused():
    admission = Admission(max_running=8, queue_limit=2, capacity=RealtimeCapacity(forced_audio_s_per_s=1.0))
    assert admission.arrive("a", now=0.0) == "start"  # nothing runs: always starts
    assert [admission.arrive(x, now=1.0) for x in "bcd"] == ["queued", "queued", "refused"]
    assert "admission_queue" in admission.refusal() and admission.refused == 1
    assert admission.due(now=2.0) == []  # a still plays
    admission.finished(3.0)
    assert admission.due(now=3.0) == [("b", 2.0)]  # one at a time, oldest first
    admission.finished(0.5)
    assert admission.due(now=3.5) == [("c", 2.5)]
    assert (admission.waited, admission.wait_s, admission.queued, admission.running) == (2, 4.5, 0, 1)


def test_a_new_request_does_not_overtake_the_queue():
    admission = Admission(max_running=1, queue_limit=4, capacity=None)
    assert admission.arrive("a", 0.0) == "start" and admission.arrive("b", 0.0) == "queued"
    admission.finished(1.0)
    assert admission.arrive("c", 1.0) == "queued"  # b waited first
    assert admission.due(1.0) == [("b", 1.0)]


def test_without_a_queue_the_refusal_names_the_limit_that_was_hit():
    slots = Admission(max_running=1, queue_limit=0, capacity=None)
    assert slots.arrive("a", 0) == "start" and slots.arrive("b", 0) == "refused"
    assert "max_inflight_requests" in slots.refusal() and "busy" in slots.refusal()
    capacity = Admission(max_running=4, queue_limit=0, capacity=RealtimeCapacity(forced_audio_s_per_s=1.0))
    assert capacity.arrive("a", 0) == "start" and capacity.arrive("b", 0) == "refused"
    assert "run dry" in capacity.refusal() and "admission_queue 0" in capacity.refusal()


def test_waiting_requests_that_were_cancelled_are_dropped():
    admission = Admission(max_running=1, queue_limit=3, capacity=None)
    for name in "abcd":
        admission.arrive(name, 0.0)
    assert admission.drop(lambda name: name in "bd") == ["b", "d"]
    admission.finished(1.0)
    assert admission.due(1.0) == [("c", 1.0)]


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("off", "off"), ("2.5", 2.5)])
def test_capacity_setting(text, expected):
    assert admission_capacity_setting(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "fast", "inf", "nan"])
def test_capacity_setting_rejects(text):
    with pytest.raises(ValueError, match="admission_capacity"):
        admission_capacity_setting(text)


def test_capacity_keys_steps_by_the_streams_sharing_the_server():
    capacity = RealtimeCapacity(prior=(0.01, 0.0))
    capacity.observe(2, 50, 1.0, batch=8)  # two steady streams got 25 frames each while 8 shared the server
    assert capacity.step_s(8) == pytest.approx(0.04)
    capacity.observe(3, 10, 1.0, batch=2)  # nonsense (more steady streams than the batch): ignored
    assert capacity.step_s(2) == pytest.approx(0.04)


def test_starts_are_staggered_by_max_starting():
    """At most max_starting streams admitted and not yet playing: the rest wait, and one starts as each earlier
    one plays its first audio (or ends without any)."""
    admission = Admission(max_running=8, queue_limit=8, capacity=None, max_starting=2)
    assert [admission.arrive(i, 0.0) for i in range(4)] == ["start", "start", "queued", "queued"]
    assert admission.due(1.0) == []
    admission.playing(2.0)
    assert admission.due(2.0) == [(2, 2.0)]
    assert admission.due(2.0) == []
    admission.finished(3.0, played=False)  # a stream that ended before its first audio frees its start too
    assert admission.due(3.0) == [(3, 3.0)]
    assert (admission.running, admission.starting) == (3, 2)
    full = Admission(max_running=8, queue_limit=0, capacity=None, max_starting=1)
    assert full.arrive("a", 0.0) == "start" and full.arrive("b", 0.0) == "refused"
    assert "streams starting (admission_max_starting 1" in full.refusal()
    unlimited = Admission(max_running=3, queue_limit=0, capacity=None)
    assert [unlimited.arrive(i, 0.0) for i in range(4)] == ["start", "start", "start", "refused"]



def test_the_default_queue_holds_only_the_free_slots_so_a_burst_past_them_is_refused_at_once():
    """queue_limit None: waiting + running stay within max_running. With capacity for 2 of 8 slots, 6 may wait; the
    7th waiting one is refused at arrival, naming max_inflight_requests and how many stream and wait."""
    admission = Admission(max_running=8, queue_limit=None, capacity=RealtimeCapacity(forced_audio_s_per_s=2.5))
    decisions = [admission.arrive(i, 0.0) for i in range(10)]
    assert decisions == ["start"] * 2 + ["queued"] * 6 + ["refused"] * 2
    assert admission.refused == 2
    message = admission.refusal()
    assert "max_inflight_requests" in message and "2 streaming and 6 waiting" in message and "8 in all" in message
    admission.finished(1.0)  # a slot frees: one waiting starts, and one place in the queue opens for a new arrival
    assert admission.due(1.0) == [(2, 1.0)]
    assert admission.arrive("late", 1.0) == "queued" and admission.arrive("later", 1.0) == "refused"
    full = Admission(max_running=2, queue_limit=None, capacity=None)  # every slot running, none waiting
    assert [full.arrive(i, 0.0) for i in range(3)] == ["start", "start", "refused"]
    assert "2 streaming and 0 waiting for admission, 2 in all (max_inflight_requests; admission_queue" in full.refusal()


def test_a_closed_loop_of_max_running_clients_is_never_refused_by_the_default_queue():
    """Each of 8 clients sends its next request once its last one ended: with starts staggered (2 at a time) and
    capacity for 3 streams, many wait, but none is refused."""
    admission = Admission(max_running=8, queue_limit=None, capacity=RealtimeCapacity(forced_audio_s_per_s=3.5),
                          max_starting=2)
    running, now = [], 0.0
    for client in range(8):
        if admission.arrive(client, now) == "start":
            running.append(client)
    assert admission.queued == 6
    for step in range(200):  # the oldest stream plays its first audio, then ends; its client sends again
        now += 1.0
        client = running.pop(0)
        admission.playing(0.5)
        admission.finished(1.0)
        decision = admission.arrive(client, now)
        assert decision != "refused"
        running += [client] if decision == "start" else []
        running += [item for item, _ in admission.due(now)]
        assert admission.queued + admission.running == 8
    assert admission.refused == 0


def test_a_request_that_waited_max_wait_is_refused_instead_of_starting_late():
    never = Admission(max_running=1, queue_limit=4, capacity=None)  # max_wait_s 0: no limit
    never.arrive("a", 0.0), never.arrive("b", 0.0)
    assert never.expired(1e6) == [] and never.queued == 1
    admission = Admission(max_running=1, queue_limit=4, capacity=None, max_wait_s=2.0)
    admission.arrive("a", 0.0)
    for name, at in (("b", 0.5), ("c", 1.0), ("d", 3.0)):
        assert admission.arrive(name, at) == "queued"
    assert admission.expired(2.4) == []
    assert admission.expired(3.2) == [("b", pytest.approx(2.7)), ("c", pytest.approx(2.2))]
    assert admission.refused == 2 and admission.queued == 1
    message = admission.expiry(2.7)
    assert "admission_max_wait 2 s" in message and "waited 2.7 s" in message and "busy" in message
    admission.finished(3.5)
    assert admission.due(3.5) == [("d", 0.5)]  # the one within the bound still starts
    with pytest.raises(ValueError, match="max_wait_s"):
        Admission(max_running=1, queue_limit=None, capacity=None, max_wait_s=-1)


def test_split_limit_keeps_the_default_queue_and_no_limit():
    assert split_limit(None, 3) is None and split_limit(0, 3) == 0 and split_limit(7, 3) == 3


@pytest.mark.parametrize("name", ["admission_max_wait", "admission_max_queue_wait"])
@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_launch_config_rejects_bad_admission_seconds(name, seconds):
    with pytest.raises(ValueError, match=f"{name} must be >= 0 seconds"):
        LaunchConfig(checkpoint_dir=".", **{name: seconds})


def test_the_outlook_says_how_many_more_arrive_would_take_and_the_refusal_then():
    """What the admission board publishes: the arrivals ``arrive`` would still start or queue, counted without
    changing anything, and the refusal the next one would get."""
    admission = Admission(max_running=2, queue_limit=None, capacity=None)
    room, refusal = admission.outlook()
    assert room == 2 and "2 streaming and 0 waiting" in refusal  # the state once both arrived
    admission.arrive("a", 0.0)
    assert admission.outlook()[0] == 1
    admission.arrive("b", 0.0)
    room, refusal = admission.outlook()
    assert room == 0 and "max_inflight_requests" in refusal and admission.refused == 0  # asking counts nothing
    assert admission.arrive("c", 0.0) == "refused" and admission.refusal() == refusal
    admission.finished(1.0)
    assert admission.outlook()[0] == 1 and admission.arrive("c", 1.0) == "start"


@pytest.mark.parametrize("limits", [dict(max_running=3, queue_limit=2, capacity=None),
                                    dict(max_running=4, queue_limit=0, capacity=None, max_starting=1),
                                    dict(max_running=2, queue_limit=None, capacity=None, max_held=5),
                                    dict(max_running=8, queue_limit=1, capacity=RealtimeCapacity(2.5))])
def test_the_outlooks_room_is_what_arrive_takes_before_refusing(limits):
    admission = Admission(**limits)
    admission.arrive("first", 0.0)
    room, refusal = admission.outlook()
    assert [admission.arrive(i, 0.0) for i in range(room + 1)][-1] == "refused"
    assert admission.refused == 1 and admission.refusal() == refusal


def test_an_instance_of_a_split_pipeline_may_hold_up_to_the_pipelines_limit():
    """One of 2 orchestrator instances of a pipeline of --max-inflight 4 runs 2 streams, but Triton may hand it
    more than its half: with the default queue it holds up to all 4 (running and waiting), the 5th is refused."""
    admission = Admission(max_running=2, queue_limit=None, capacity=None, max_held=4)
    assert [admission.arrive(i, 0.0) for i in range(5)] == ["start", "start", "queued", "queued", "refused"]
    assert "2 streaming and 2 waiting for admission, 4 in all" in admission.refusal()
    with pytest.raises(ValueError, match="max_held"):
        Admission(max_running=4, queue_limit=None, capacity=None, max_held=2)


def test_the_queue_drain_is_learned_from_starts_out_of_the_queue_while_it_holds_requests():
    drain = QueueDrain()
    behind_one = Occupancy(running=1, starting=0, stream_limit=1, max_starting=0)  # a stream must end first
    assert drain.per_second() is None and drain.wait_s(0, behind_one) is None
    drain.update(10.0, waiting=True)  # a request queues
    drain.update(12.0, waiting=True, started=1)  # one starts 2 s later, another still waits
    assert drain.per_second() is None  # one gap may be chance: not learned yet
    drain.update(14.0, waiting=False, started=1)  # the last one starts 2 s later: empty
    assert drain.per_second() == pytest.approx(0.5) and drain.wait_s(2, behind_one) == pytest.approx(6.0)
    drain.update(100.0, waiting=True)  # 86 s with nothing waiting: starts followed arrivals, not counted
    drain.update(102.0, waiting=True, started=1)
    assert drain.per_second() == pytest.approx(0.5)
    drain.update(103.0, waiting=False, started=2)  # two more at once, 1 s later: a faster pace
    assert 0.5 < drain.per_second() < 2.0
    stuck = QueueDrain()
    for now in (2.0, 4.0):
        stuck.update(now, waiting=True, started=1)
    stuck.update(30.0, waiting=True)  # nothing started for 26 s: the queue reads slow before its next start
    assert stuck.per_second() < 0.1
    dropped = QueueDrain()
    dropped.update(0.0, waiting=True)
    dropped.update(1.0, waiting=True, started=2)
    dropped.emptied()  # cancelled at a time not given: what follows until the next update is not counted
    dropped.update(50.0, waiting=False)
    assert dropped.per_second() == pytest.approx(2.0)


def learned(max_queue_wait_s: float, max_held: int = 8) -> Admission:
    """One stream at a time, each 2 s long, 3 waiting behind the first: once two started out of the queue the
    drain rate is learned, 0.5 starts per second; one still waits (``d``), behind ``c`` streaming."""
    admission = Admission(max_running=1, queue_limit=None, capacity=None, max_held=max_held,
                          max_queue_wait_s=max_queue_wait_s)
    assert [admission.arrive(name, 0.0) for name in "abcd"] == ["start", "queued", "queued", "queued"]
    for now, name in ((2.0, "b"), (4.0, "c")):
        admission.finished(2.0)
        assert admission.due(now) == [(name, now)]
    return admission


def test_a_request_whose_expected_wait_passes_max_queue_wait_is_refused_at_once():
    admission = learned(max_queue_wait_s=3.0)
    assert admission.expected_wait_s == pytest.approx(4.0)  # behind d: 2 starts at 0.5 a second
    assert admission.arrive("e", 4.0) == "refused" and admission.queued == 1 and admission.refused == 1
    message = admission.refusal()
    assert message == ("server busy: an estimated 4.0 s wait for admission behind 1 streaming and 1 waiting "
                       "(admission_max_queue_wait 3 s); retry later")
    admission.finished(2.0)
    assert admission.due(6.0) == [("d", 6.0)]
    assert admission.arrive("f", 6.0) == "queued"  # first in the queue: 2 s expected
    assert admission.arrive("g", 6.0) == "refused"  # behind f: 4 s expected
    assert admission.arrive("h", 6.0) == "refused" and admission.refused == 3


def test_max_queue_wait_refuses_nothing_on_a_cold_server():
    """A server on which no stream ended yet knows no lifetime, and none has started out of its queue: the queue
    limits alone decide, however short the bound. The first stream to end teaches a lifetime: the bound holds."""
    admission = Admission(max_running=1, queue_limit=None, capacity=None, max_held=4, max_queue_wait_s=0.001)
    assert admission.expected_wait_s == 0.0
    assert [admission.arrive(i, 0.0) for i in range(5)] == ["start", "queued", "queued", "queued", "refused"]
    assert "max_inflight_requests" in admission.refusal()  # the free slots, not the wait
    assert admission.expected_wait_s == 0.0
    admission.playing(0.5)  # a start length alone: every place here waits for a stream to end, still unknown
    assert admission.arrive("still", 1.0) == "refused" and "max_inflight_requests" in admission.refusal()
    admission.finished(5.0)
    assert admission.due(5.0) == [(1, 5.0)]
    assert admission.arrive("late", 5.0) == "refused" and "admission_max_queue_wait" in admission.refusal()
    assert admission.expected_wait_s == pytest.approx(15.0)  # behind 2 waiting: 3 streams of 5 s to end


def warm(admission: Admission, lifetime_s: float, start_s: float, streams: int = 4, at: float = 0.0) -> float:
    """``streams`` streams one after the other, each alone (the queue never holds anything): returns when the last
    ended."""
    for _ in range(streams):
        assert admission.arrive("warm-up", at) == "start"
        admission.playing(start_s)
        admission.finished(lifetime_s)
        at += lifetime_s
    return at


def test_the_prior_waits_for_the_limit_that_binds_at_each_place():
    """The ``ahead + 1``-th start from now needs a start slot (the stagger: starts finish at max_starting / start
    length) and a stream slot (streams end at running / lifetime): its wait is the longer one."""
    drain = QueueDrain()
    burst = Occupancy(running=3, starting=2, stream_limit=4, max_starting=2)
    assert drain.prior_wait_s(0, burst) is None  # cold: nothing known
    drain.stream_played(0.5)
    assert drain.prior_wait_s(0, burst) == pytest.approx(0.25)  # a free stream slot: one start to finish
    assert drain.prior_wait_s(1, burst) is None  # the stream slots are taken: a stream must end, lifetime unknown
    drain.stream_ended(8.0, played=True)
    assert drain.prior_wait_s(1, burst) == pytest.approx(8.0 / 3)  # one of 3 streams of 8 s ends (not 2 starts)
    assert drain.prior_wait_s(2, burst) == pytest.approx(2 * 8.0 / 3)
    unstaggered = Occupancy(running=1, starting=1, stream_limit=4, max_starting=0)
    assert drain.prior_wait_s(2, unstaggered) == 0.0  # free slots, no stagger: it would start at once
    drain.stream_ended(2.0, played=False)  # it ended without audio: its start lasted its life
    assert drain.lifetime_s.value == pytest.approx(5.0) and drain.start_s.value == pytest.approx(1.25)
    recent = RecentMean(memory=4)
    for value in (1.0, 3.0, 5.0, 7.0):
        recent.add(value)
    assert recent.value == pytest.approx(4.0)  # the plain mean of the first 4
    recent.add(8.0)
    assert recent.value == pytest.approx(5.0)  # then each new one weighs 1/4


def test_the_prior_refuses_a_bursts_surplus_at_once_on_a_warm_server_whose_queue_never_held_anything():
    """Issue 48's burst in small: a warm server (streams of 8 s, starts of 0.5 s, one at a time: nothing ever
    queued, so no drain rate is measured) with room for 4 streams by its capacity, 2 starting at once. One stream
    plays when 4 arrive at once: 2 start, the next waits for a start to finish (0.25 s), the one after it for one
    of 3 streams to end (2.7 s); the 5th would wait for two (5.3 s): past 3 s, refused at once."""
    admission = Admission(max_running=8, queue_limit=None, capacity=RealtimeCapacity(forced_audio_s_per_s=5.0),
                          max_starting=2, max_held=16, max_queue_wait_s=3.0)  # 5 audio-s/s: 4 streams at 1.1x
    now = warm(admission, lifetime_s=8.0, start_s=0.5)
    assert admission.arrive("playing", now) == "start"
    admission.playing(0.5)
    room, refusal = admission.outlook()
    assert room == 4  # the outlook agrees with arrive, from the burst's first request
    assert [admission.arrive(i, now + 1.0) for i in range(5)] == ["start", "start", "queued", "queued", "refused"]
    assert admission.refusal() == refusal == ("server busy: an estimated 5.3 s wait for admission behind 3 "
                                              "streaming and 2 waiting (admission_max_queue_wait 3 s); retry later")
    assert admission.expected_wait_s == pytest.approx(16.0 / 3)
    off = Admission(max_running=8, queue_limit=None, capacity=RealtimeCapacity(forced_audio_s_per_s=5.0),
                    max_starting=2, max_held=16)  # the same without the bound: the free slots hold 13
    now = warm(off, lifetime_s=8.0, start_s=0.5)
    off.arrive("playing", now)
    off.playing(0.5)
    assert [off.arrive(i, now + 1.0) for i in range(16)] == ["start"] * 2 + ["queued"] * 13 + ["refused"]


def test_the_measured_drain_rate_replaces_the_prior_after_min_starts():
    """Streams of 1 s taught the prior; then streams of 5 s queue up. After one start out of the queue the prior
    (its lifetime only a little longer now) still decides; after two the measured pace, 1 start in 5 s, does."""
    admission = Admission(max_running=1, queue_limit=None, capacity=None, max_held=8, max_queue_wait_s=3.0)
    for at in range(16):
        assert admission.arrive("short", float(at)) == "start"
        admission.playing(0.2)
        admission.finished(1.0)
    assert admission.arrive("a", 100.0) == "start"
    assert [admission.arrive(name, 100.0) for name in "bcde"] == ["queued"] * 3 + ["refused"]  # 4 s behind 3
    admission.finished(5.0)  # lifetimes (1 s x 16, 5 s): a mean of 1.25 s
    assert admission.due(105.0) == [("b", 5.0)]
    assert admission.expected_wait_s == pytest.approx(3 * 1.25)  # behind c and d: the prior
    admission.finished(5.0)
    assert admission.due(110.0) == [("c", 10.0)]  # two starts out of the queue, 5 s apart: 0.2 a second
    assert admission.expected_wait_s == pytest.approx(10.0)  # behind d: the measured pace (the prior said ~3 s)
    assert admission.arrive("f", 110.0) == "refused" and "an estimated 10.0 s wait" in admission.refusal()


def test_the_outlook_counts_the_expected_wait_as_arrive_does():
    admission = learned(max_queue_wait_s=7.0)  # 0.5 starts/s: 3 may wait (the 3rd expects 6 s, a 4th 8 s)
    room, refusal = admission.outlook()
    assert room == 2 and "an estimated 8.0 s wait" in refusal and "admission_max_queue_wait 7 s" in refusal
    assert [admission.arrive(i, 4.0) for i in range(room + 1)] == ["queued", "queued", "refused"]
    assert admission.refusal() == refusal
    slots = learned(max_queue_wait_s=9.0, max_held=4)  # the free slots bind first (3 may wait, by 8 s 4): named
    room, refusal = slots.outlook()
    assert room == 2 and "max_inflight_requests" in refusal and "admission_max_queue_wait" not in refusal
    assert [slots.arrive(i, 4.0) for i in range(room + 1)] == ["queued", "queued", "refused"]


def test_max_queue_wait_is_off_by_default():
    """The closed-loop benchmarks rely on a closed loop of up to max_running clients never being refused."""
    assert LaunchConfig(checkpoint_dir=".").admission_max_queue_wait == 0.0
    assert cli.build_parser().parse_args(["serve"]).admission_max_queue_wait == 0.0
    admission = learned(max_queue_wait_s=0.0)
    assert admission.expected_wait_s == pytest.approx(4.0)  # learned all the same: the gauge shows it
    assert [admission.arrive(i, 4.0) for i in range(7)] == ["queued"] * 6 + ["refused"]
    assert "max_inflight_requests" in admission.refusal()
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        Admission(max_running=1, queue_limit=None, capacity=None, max_queue_wait_s=-1.0)


def test_the_serve_flag_rejects_bad_seconds_naming_itself(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--admission-max-queue-wait", "-1"])
    assert "--admission-max-queue-wait: must be a number of seconds >= 0, got '-1'" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--admission-max-queue-wait", "2"])
    assert args.admission_max_queue_wait == 2.0
