"""bench.pyspy_summary: a stub's samples over all its threads together come before each thread's own."""

from __future__ import annotations

from omni_triton.bench.pyspy_summary import parse, report

RAW = """\
thread (11): omni-request_0;Thread.run (threading.py:982);Session.run (omni_triton/pipeline/session.py:93);wait (x.py:1) 3
thread (12): omni-request_1;Thread.run (threading.py:982);Session.run (omni_triton/pipeline/session.py:93);emit (y.py:2) 1
thread (13): talker-frames;Thread.run (threading.py:982);_AudioWorker._run (omni_triton/pipeline/session.py:279) 4
"""


def test_parse_keys_stacks_by_thread_name():
    threads = parse(RAW)
    assert set(threads) == {"omni-request_0", "omni-request_1", "talker-frames"}
    assert threads["talker-frames"] == [(["Thread.run (threading.py:982)",
                                          "_AudioWorker._run (omni_triton/pipeline/session.py:279)"], 4)]


def test_all_threads_sum_every_thread_s_samples(tmp_path):
    (tmp_path / "orchestrator-42.txt").write_text(RAW)
    text = report(tmp_path, top=5)
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "## orchestrator-42 / all threads (8 samples)"
    assert "## orchestrator-42 / omni-request_0 (3 samples)" in sections
    everything = text.split("## orchestrator-42 / omni-request_0")[0]
    # inclusive over all threads: both request threads pass through Session.run (4 of 8), the worker its own (4)
    assert "| `Session.run (omni_triton/pipeline/session.py:93)` | 50.0 |" in everything
    assert "| `_AudioWorker._run (omni_triton/pipeline/session.py:279)` | 50.0 |" in everything
