"""The orchestrator instances' admission records that preprocess reads (omni_triton/shared/admission_board.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from omni_triton.shared.admission_board import (RECORD_BYTES, BoardWriter, EarlyRefusal, Outlook, board_path, decode,
                                                encode, instance_names, read_outlook, remove_boards)

FULL = "server busy: 4 requests in flight (max_inflight_requests); retry later"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_is_refused_early_only_when_no_instance_has_room(tmp_path):
    paths = [tmp_path / name for name in instance_names(pipelines=2, per_pipeline=1)]
    assert [path.name for path in paths] == ["0.0", "1.0"]
    early = EarlyRefusal(paths)
    assert early.refusal() is None  # nothing published yet: the orchestrator decides
    first, second = BoardWriter(paths[0]), BoardWriter(paths[1])
    assert early.refusal() is None  # created, nothing written: starting
    first.publish(0, FULL, received=4)
    second.publish(1, "server busy: 2 streaming and 2 waiting for admission", received=3)
    assert early.refusal() is None  # the other pipeline has room
    second.publish(0, "server busy: 2 streaming and 2 waiting for admission", received=4)
    assert early.refusal() == FULL
    first.publish(1, FULL, received=4)  # a stream ended there
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
    writer.publish(2, FULL, received=10)
    assert early.refusal() is None
    early.let_through()
    assert early.refusal() is None
    early.let_through()
    assert early.refusal() == FULL and early.in_transit == 2  # both on their way: the room is theirs
    writer.publish(1, FULL, received=11)  # one arrived and started
    assert early.refusal() == FULL and early.in_transit == 1
    writer.publish(1, FULL, received=12)  # the other arrived and was refused (its state changed): room 1 again
    assert early.refusal() is None and early.in_transit == 0
    early.let_through()
    clock.now = 5.1  # never received (cancelled on its way): no longer counted
    assert early.refusal() is None and early.in_transit == 0
    writer.close()


def test_a_reloaded_instance_counts_its_requests_from_zero(tmp_path):
    path = tmp_path / "0.0"
    clock = Clock()
    path.write_bytes(encode(Outlook(1, FULL, received=50, writer=os.getpid() + 1)))  # a dead writer's: not read
    writer = BoardWriter(path)
    writer.publish(1, FULL, received=0)
    early = EarlyRefusal([path], clock=clock)
    assert early.refusal() is None
    early.let_through()
    assert early.refusal() == FULL
    writer.publish(1, FULL, received=1)
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
BoardWriter(Path(sys.argv[1])).publish(0, "server busy: 4 requests in flight (max_inflight_requests)", received=4)
print("published", flush=True)
time.sleep(600)
"""


def test_records_keep_whole_characters_and_reject_a_torn_or_empty_record():
    long = "é" * RECORD_BYTES  # two bytes each: cut at a character boundary
    record = encode(Outlook(3, long, received=7, writer=42))
    outlook = decode(record)
    assert len(record) == RECORD_BYTES and outlook.room == 3 and outlook.received == 7 and outlook.writer == 42
    assert outlook.refusal and set(outlook.refusal) == {"é"} and len(outlook.refusal.encode()) < RECORD_BYTES
    assert decode(record[:10]) is None and decode(b"") is None and decode(bytes(RECORD_BYTES)) is None


def test_the_launcher_removes_what_a_crashed_server_left():
    pid = 2 ** 22 + os.getpid()  # no real server
    paths = [board_path(pid, name) for name in instance_names(1, 2)]
    for path in paths:  # as a killed instance leaves its record
        path.write_bytes(encode(Outlook(0, "server busy", received=1, writer=pid)))
    assert EarlyRefusal(paths).refusal() is None  # nobody holds them: a dead process's, not read
    remove_boards(pid)
    assert not any(path.exists() for path in paths)
