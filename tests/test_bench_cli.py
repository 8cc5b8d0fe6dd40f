"""`omni-triton bench` end to end on the tiny checkpoint: the streaming server and the in-process baseline,
one report with every level, ratios and (when matplotlib is installed) plots."""

from __future__ import annotations

import json

import pytest

from omni_triton.bench.cli import main
from omni_triton.bench.workload import QUICK

pytestmark = pytest.mark.server


def test_bench_writes_a_report_for_every_system_and_level(triton_server, tiny_checkpoint, tmp_path):
    out = tmp_path / "report"
    code = main(["--url", triton_server.grpc_url, "--checkpoint", str(tiny_checkpoint), "--quick",
                 "--systems", "server,inprocess", "--concurrency", "1,2", "--requests-per-level", "2",
                 "--warmup", "0", "--trace", str(tmp_path / "trace"), "--out", str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    rows = {(r["system"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {("server", 1), ("server", 2), ("inprocess", 1), ("inprocess", 2)}
    frames_seconds = QUICK.audio_frames / 12.5
    for row in rows.values():
        assert row["requests"] == 2 and row["failed"] == 0
        assert row["ttft_p50"] > 0 and row["ttfa_p50"] > 0
        # lengths pinned by the workload: the frames asked for, less the vocoder's edge trim (< 1 frame)
        assert frames_seconds - 1 / 12.5 < row["audio_s_per_request"] <= frames_seconds
    assert {(r["system"], r["concurrency"]) for r in report["ratios"]} == {("inprocess", 1), ("inprocess", 2)}
    assert "| server | 1 | 2 | 0 |" in (out / "results.md").read_text()
    # the local server's processes, by instance: the stages worked during the level, the in-process rows have none
    cpu = rows["server", 2]["server_cpu_pct"]
    assert {"tritonserver", "orchestrator_0_0", "thinker_0_0", "talker_0_0", "code2wav_0_0"} <= set(cpu)
    assert all(cpu[stage] > 0 for stage in ("orchestrator_0_0", "thinker_0_0", "talker_0_0", "code2wav_0_0"))
    assert rows["inprocess", 1]["server_cpu_pct"] is None
    per_request = rows["server", 2]["server_cpu_ms_per_request"]
    assert set(per_request) == set(cpu) and per_request["orchestrator_0_0"] > 0
    assert rows["inprocess", 1]["server_cpu_ms_per_request"] is None
    assert "CPU per completed request, ms" in (out / "results.md").read_text()
    assert "| system | conc | tritonserver | code2wav_0_0 |" in (out / "results.md").read_text()
    # Triton's own statistics per model over the level: every request of it reached each stage once at least
    models = rows["server", 2]["triton_models"]
    assert models["thinker"]["requests"] == 2 and models["talker"]["requests"] >= 2
    assert all(models[stage]["executions"] >= 1 and models[stage]["queue_ms"] >= 0 and models[stage]["compute_ms"] > 0
               for stage in ("thinker", "talker", "code2wav"))
    assert rows["inprocess", 1]["triton_models"] is None
    assert "Triton's statistics per model during each level" in (out / "results.md").read_text()
    # --trace: a TTFA breakdown per level; this server was started without a trace dir, so its rows hold the
    # client's own span only, while the in-process pipeline's show every stage (tests/test_trace_breakdown.py
    # covers a traced server)
    rows = {(r["system"], r["concurrency"]): r for r in report["ttfa_breakdown"]}
    assert set(rows) == {("server", 1), ("server", 2), ("inprocess", 1), ("inprocess", 2)}
    assert all(row["requests"] == 2 for row in rows.values())
    assert {"thinker prefill + first token", "talker prefill + first frame", "code2wav first chunk"} <= set(
        rows["inprocess", 1]["segments"])
    assert "Where the time to first audio goes" in (out / "results.md").read_text()
    # the in-process engines' step logs: where each engine's wall time went during the level, all of it
    engines = rows["inprocess", 1]["engines"]
    assert set(engines) == {"thinker", "talker"}
    for shares in engines.values():
        assert sum(shares[f"{share}_pct"] for share in ("gpu", "host", "input", "idle")) == pytest.approx(100)
        assert shares["steps"] > 0 and shares["host_pct"] > 0
    assert "| talker steps: waiting for input % of wall |" in (out / "results.md").read_text()
    # the in-process sessions' chunks (no code2wav stage there: the pacer's rows only)
    assert rows["inprocess", 1]["code2wav"]["chunks_sent"] >= 2 and "calls" not in rows["inprocess", 1]["code2wav"]
    assert "| code2wav pacer chunk frames (p50) |" in (out / "results.md").read_text()
    # starts (session start -> first audio) over the level: two closed-loop streams never start three at once
    starting = rows["inprocess", 2]["starting"]
    assert 1 <= starting["starting_max"] <= 2 and 0 < starting["starting_mean"] <= 2
    assert starting["start_mean_ms"] > 0
    assert "| streams starting at once (mean / most; admitted -> first audio) |" in (out / "results.md").read_text()
    if not any("plots skipped" in note for note in report["notes"]):
        assert (out / "ttfa.png").is_file() and (out / "throughput.png").is_file()
