"""The orchestrator instances' admission records that preprocess reads (omni_triton/shared/admission_board.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from omni_triton.shared.admission_board import (RECORD_BYTES, BoardWriter, board_path, decode, encode,
                                                instance_names, refusal_of_all, remove_boards)


def test_a_request_is_refused_early_only_when_every_instance_would_refuse_it(tmp_path):
    paths = [tmp_path / name for name in instance_names(pipelines=2, per_pipeline=1)]
    assert [path.name for path in paths] == ["0.0", "1.0"]
    assert refusal_of_all(paths) is None  # nothing published yet: the orchestrator decides
    first, second = BoardWriter(paths[0]), BoardWriter(paths[1])
    assert refusal_of_all(paths) is None
    first.publish("server busy: 4 requests in flight (max_inflight_requests); retry later")
    assert refusal_of_all(paths) is None  # the other pipeline may take it
    second.publish("server busy: 2 streaming and 2 waiting for admission")
    assert refusal_of_all(paths) == "server busy: 4 requests in flight (max_inflight_requests); retry later"
    first.publish(None)  # a stream ended there
    assert refusal_of_all(paths) is None
    second.close()
    assert not paths[1].exists() and refusal_of_all(paths) is None  # a stopped or reloading instance: not refused
    first.close()


def test_the_record_of_a_killed_instance_is_not_read(tmp_path):
    """A stub killed while full leaves its record: preprocess must not refuse on it until the reload writes anew."""
    path = tmp_path / "0.0"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "published"
        assert refusal_of_all([path]) == "server busy: 4 requests in flight (max_inflight_requests)"
    finally:
        writer.kill()
        writer.wait()
    assert path.exists() and refusal_of_all([path]) is None


WRITER = """
import sys, time
from pathlib import Path
from omni_triton.shared.admission_board import BoardWriter
BoardWriter(Path(sys.argv[1])).publish("server busy: 4 requests in flight (max_inflight_requests)")
print("published", flush=True)
time.sleep(600)
"""


def test_records_keep_whole_characters_and_reject_a_torn_or_empty_record():
    long = "é" * RECORD_BYTES  # two bytes each: cut at a character boundary
    record = encode(long)
    assert len(record) == RECORD_BYTES and decode(record) == "é" * ((RECORD_BYTES - 1) // 2)
    assert decode(encode(None)) is None and decode(record[:10]) is None and decode(b"") is None


def test_the_launcher_removes_what_a_crashed_server_left():
    pid = 2 ** 22 + os.getpid()  # no real server
    paths = [board_path(pid, name) for name in instance_names(1, 2)]
    for path in paths:  # as a killed instance leaves its record
        path.write_bytes(encode("server busy"))
    assert refusal_of_all(paths) is None  # nobody holds them: a dead process's, not read
    remove_boards(pid)
    assert not any(path.exists() for path in paths)
