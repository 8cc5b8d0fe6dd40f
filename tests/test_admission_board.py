"""The orchestrator instances' admission records that preprocess reads (omni_triton/shared/admission_board.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from omni_triton.shared.admission_board import (DIRECT_CALL, LET_THROUGH, RECORD_BYTES, BoardWriter, EarlyRefusal,
                                                Outlook, board_path, decode, encode, instance_names, on_its_way,
                                                read_outlook, remove_boards)

FULL = "server busy: 4 requests in flight (max_inflight_requests); retry later"


class Clock:
    """The host's monotonic clock in ns, as preprocess and the orchestrator read it, moved by hand."""

    def __init__(self):
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def test_a_request_is_refused_early_only_when_no_instance_has_room(tmp_path):
    paths = [tmp_path / name for name in instance_names(pipelines=2, per_pipeline=1)]
    assert [path.name for path in paths] == ["0.0", "1.0"]
    early = EarlyRefusal(paths)
    assert early.refusal() is None  # nothing published yet: the orchestrator decides
    first, second = BoardWriter(paths[0]), BoardWriter(paths[1])
    assert early.refusal() is None  # created, nothing written: starting
    first.publish(0, FULL, latest=0)
    second.publish(1, "server busy: 2 streaming and 2 waiting for admission", latest=0)
    assert early.refusal() is None  # the other pipeline has room
    second.publish(0, "server busy: 2 streaming and 2 waiting for admission", latest=0)
    assert early.refusal() == FULL
    first.publish(1, FULL, latest=0)  # a stream ended there
    assert early.refusal() is None
    second.close()
    assert not paths[1].exists() and early.refusal() is None  # a stopped or reloading instance: not refused
    first.close()


def test_requests_let_through_take_the_room_until_an_instance_received_them(tmp_path):
    """A burst: the orchestrator's outlook is stale while requests are on their way to it; those let through are
    counted against its room, so no more go on than it has room for."""
    path = tmp_path / "0.0"
    writer, clock = BoardWriter(path), Clock()
    early = EarlyRefusal([path], transit_s=5.0, clock=clock)
    writer.publish(2, FULL, latest=0)
    assert early.refusal() is None
    first = early.let_through()
    assert early.refusal() is None
    second = early.let_through()  # the same clock reading: still a later mark
    assert second > first and early.refusal() == FULL and early.in_transit == 2  # the room is theirs
    writer.publish(1, FULL, latest=first)  # one arrived and started
    assert early.refusal() == FULL and early.in_transit == 1
    writer.publish(1, FULL, latest=second)  # the other arrived and was refused (its state changed): room 1 again
    assert early.refusal() is None and early.in_transit == 0
    writer.close()


def test_a_request_that_never_arrives_stops_counting_at_the_next_arrival_or_with_age(tmp_path):
    """Cancelled on its way, failed in the ensemble, its instance killed: it must not keep taking a place (counted
    by number, one lost under a steady flow of requests took a place for as long as the flow lasted)."""
    path = tmp_path / "0.0"
    writer, clock = BoardWriter(path), Clock()
    early = EarlyRefusal([path], transit_s=5.0, clock=clock)
    writer.publish(1, FULL, latest=0)
    early.let_through()  # lost
    assert early.refusal() == FULL
    for _ in range(3):  # a flow of arrivals after it, each finding room 1
        clock.now += 1_000_000
        writer.publish(1, FULL, latest=early.let_through())
        assert early.refusal() is None and early.in_transit == 0
    clock.now += 1_000_000
    lost = early.let_through()  # and nothing arrives after it
    clock.now = lost + 5_000_000_000
    assert early.refusal() == FULL
    clock.now += 1
    assert early.refusal() is None and early.in_transit == 0
    writer.close()


def test_only_a_request_of_the_ensemble_is_on_its_way_to_an_orchestrator():
    """The ensemble asks preprocess for exactly the outputs it maps (the mark, never DIRECT_CALL); a client calling
    preprocess itself asks for every output by default, or names those it wants."""
    ensemble = ["INPUT_IDS", "AUDIO_FEATURES", "MAX_TOKENS", LET_THROUGH]
    assert on_its_way(ensemble)
    assert not on_its_way(ensemble + [DIRECT_CALL])  # a direct call's default: every output
    assert not on_its_way(["INPUT_IDS"]) and not on_its_way([])


def test_a_reloaded_instance_starts_with_no_request_received(tmp_path):
    path = tmp_path / "0.0"
    clock = Clock()
    early = EarlyRefusal([path], clock=clock)
    path.write_bytes(encode(Outlook(1, FULL, latest=clock.now + 10**9)))  # a dead writer's: not read
    writer = BoardWriter(path)
    writer.publish(1, FULL, latest=0)
    mark = early.let_through()
    assert early.refusal() == FULL
    writer.publish(1, FULL, latest=mark)
    assert early.refusal() is None and early.in_transit == 0
    writer.close()


def test_the_record_of_a_killed_instance_is_not_read(tmp_path):
    """A stub killed while full leaves its record: preprocess must not refuse on it until the reload writes anew."""
    path = tmp_path / "0.0"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "published"
        assert EarlyRefusal([path]).refusal() == "server busy: 4 requests in flight (max_inflight_requests)"
    finally:
        writer.kill()
        writer.wait()
    assert path.exists() and read_outlook(path) is None and EarlyRefusal([path]).refusal() is None


WRITER = """
import sys, time
from pathlib import Path
from omni_triton.shared.admission_board import BoardWriter
BoardWriter(Path(sys.argv[1])).publish(0, "server busy: 4 requests in flight (max_inflight_requests)", latest=4)
print("published", flush=True)
time.sleep(600)
"""


def test_records_keep_whole_characters_and_reject_a_torn_or_empty_record():
    long = "é" * RECORD_BYTES  # two bytes each: cut at a character boundary
    record = encode(Outlook(3, long, latest=7))
    outlook = decode(record)
    assert len(record) == RECORD_BYTES and outlook.room == 3 and outlook.latest == 7
    assert outlook.refusal and set(outlook.refusal) == {"é"} and len(outlook.refusal.encode()) < RECORD_BYTES
    assert decode(record[:10]) is None and decode(b"") is None and decode(bytes(RECORD_BYTES)) is None


def test_the_launcher_removes_what_a_crashed_server_left():
    pid = 2 ** 22 + os.getpid()  # no real server
    paths = [board_path(pid, name) for name in instance_names(1, 2)]
    for path in paths:  # as a killed instance leaves its record
        path.write_bytes(encode(Outlook(0, "server busy", latest=1)))
    assert EarlyRefusal(paths).refusal() is None  # nobody holds them: a dead process's, not read
    remove_boards(pid)
    assert not any(path.exists() for path in paths)
