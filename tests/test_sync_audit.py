"""benchmarks/sync_audit.py: the sync debug mode's warnings from any thread, grouped by thread and call site in
omni_triton; other warnings pass on. The audit itself runs on the CPU (no device to wait for: nothing found); on a
GPU it is a device run's job."""

from __future__ import annotations

import json
import threading
import traceback
import warnings

from benchmark_scripts import load_script

sync_audit = load_script("sync_audit")


def frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_the_call_site_is_the_innermost_package_frame_with_its_callers():
    stack = [frame("/x/threading.py", 1, "run"), frame("/r/omni_triton/engine/engine.py", 10, "_step_loop"),
             frame("/r/omni_triton/engine/engine.py", 20, "_apply"), frame("/r/omni_triton/engine/stage.py", 30,
                                                                         "cache_keys"),
             frame("/v/torch/_tensor.py", 40, "cpu")]
    assert sync_audit.call_site(stack) == ("engine/stage.py:30 cache_keys",
                                           "engine/engine.py:20 _apply < engine/engine.py:10 _step_loop")
    assert sync_audit.call_site(stack[:1]) == ("(outside omni_triton)", "")


def test_the_recorder_counts_sync_warnings_of_every_thread_and_passes_the_others_on():
    shown = []
    previous = warnings.showwarning
    warnings.showwarning = lambda message, *rest: shown.append(str(message))
    try:
        with sync_audit.SyncRecorder() as recorder:
            worker = threading.Thread(name="engine-step", target=lambda: [
                warnings.warn("called a synchronizing CUDA operation") for _ in range(2)])
            worker.start()
            worker.join()
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else")
    finally:
        warnings.showwarning = previous
    assert recorder.sites == {("engine-step", "(outside omni_triton)", ""): 2,
                              (threading.current_thread().name, "(outside omni_triton)", ""): 1}
    assert shown == ["something else"]


def test_the_audit_serves_its_requests_and_writes_its_table(tmp_path):
    result = sync_audit.main(["--device", "cpu", "--requests", "2", "--concurrency", "2", "--max-tokens", "3",
                              "--audio-frames", "6", "--num-blocks", "128", "--out-dir", str(tmp_path)])
    assert result["completed_with_audio"] == 2 and result["syncs"] == 0 and result["sites"] == []
    assert json.loads((tmp_path / "sync_audit.json").read_text()) == result
    assert "| thread | call site | callers | count |" in (tmp_path / "sync_audit.md").read_text()
