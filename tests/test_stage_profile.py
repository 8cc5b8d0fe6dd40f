"""Profile windows in the stage processes (stage_profile.py) and their summaries (bench/stage_profiles.py): the
trigger files, the watcher's bookkeeping, a real torch.profiler window on the CPU, and the summary of a trace."""

from __future__ import annotations

import json
import time

import pytest
import torch

from omni_triton.bench.stage_profiles import ProfileWindows, busy_us, markdown, summarize, summarize_dir
from omni_triton.stage_profile import _profile, pending_windows, request_window


def test_trigger_files_name_their_window_once(tmp_path):
    request_window(tmp_path, "server-c32", 1.5)
    done: set[str] = set()
    assert pending_windows(tmp_path, done) == [("server-c32", 1.5)]
    assert pending_windows(tmp_path, done) == []  # handled once
    request_window(tmp_path, "server-c64", 0.5)
    assert pending_windows(tmp_path, done) == [("server-c64", 0.5)]


@pytest.mark.parametrize("label, seconds", [("../escape", 1.0), ("", 1.0), ("ok", 0.0)])
def test_bad_windows_are_refused(tmp_path, label, seconds):
    with pytest.raises(ValueError):
        request_window(tmp_path, label, seconds)


def test_a_window_writes_a_chrome_trace_of_this_process(tmp_path):
    path = tmp_path / "c1" / "thinker-1.json"

    def busy():
        for _ in range(20):
            torch.ones(64, 64) @ torch.ones(64, 64)

    import threading
    worker = threading.Thread(target=lambda: [busy() for _ in range(20)])
    worker.start()
    _profile(path, 0.2)
    worker.join()
    trace = json.loads(path.read_text())
    assert trace["traceEvents"]
    assert summarize(trace)["window_ms"] > 0


def test_summary_of_a_trace_counts_busy_gpu_time_and_blocking_calls(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "moe_kernel", "ts": 0, "dur": 400, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "attention", "ts": 200, "dur": 400, "tid": 7},  # overlaps: 600 busy
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 100, "dur": 300, "tid": 11},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100, "dur": 5, "tid": 11},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 900, "dur": 100, "tid": 11},
    ]
    summary = summarize({"traceEvents": events})
    assert summary["window_ms"] == pytest.approx(1.0)
    assert summary["gpu_busy_pct"] == pytest.approx(60.0)
    assert summary["kernels"] == 2 and summary["top_kernels"][0]["name"] in ("moe_kernel", "attention")
    assert summary["threads"] == {"11": {"cudaStreamSynchronize": pytest.approx(0.3)}}
    (tmp_path / "talker-5.json").write_text(json.dumps({"traceEvents": events}))
    assert "talker-5" in markdown(summarize_dir(tmp_path))


def test_busy_time_is_the_union_of_intervals():
    assert busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_bench_windows_summarise_what_the_stages_wrote(tmp_path):
    windows = ProfileWindows(tmp_path, delay_s=0.0, seconds=0.1, settle_s=0.0)
    trigger = tmp_path / "server-c8.trigger"
    with windows.during("server-c8"):
        deadline = time.monotonic() + 10
        while not trigger.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the level runs past the window's delay: its trigger is written
    (tmp_path / "server-c8").mkdir()
    (tmp_path / "server-c8" / "code2wav-3.json").write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10}]}))
    notes = windows.summaries()
    assert trigger.read_text() == "0.1" and windows.labels == ["server-c8"]
    assert "code2wav 100%" in notes[0]
    assert (tmp_path / "server-c8" / "stage_profiles.md").exists()
