"""`omni-triton bench --request-rate` against a real tritonserver on the tiny checkpoint: two low rates for a few
seconds of short requests, the report's fields present and consistent with each other and with the schedule."""

from __future__ import annotations

import json

import pytest

from omni_triton.bench.cli import main
from omni_triton.bench.open_loop import arrival_times
from omni_triton.bench.workload import QUICK

pytestmark = pytest.mark.server

RATES, DURATION_S, SEED = (0.5, 1.0), 4.0, 1


def test_open_loop_reports_every_rate_and_its_goodput(triton_server, tiny_checkpoint, tmp_path):
    out = tmp_path / "open-loop"
    # a generous limit: on a shared CPU the verdicts depend on the machine, the fields must not
    code = main(["--url", triton_server.grpc_url, "--checkpoint", str(tiny_checkpoint), "--quick", "--warmup", "1",
                 "--request-rate", ",".join(map(str, RATES)), "--duration", str(DURATION_S),
                 "--arrival-seed", str(SEED), "--ttfa-p95-limit-ms", "60000", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert "partial" not in report and report["command"].startswith("omni-triton bench --url")
    assert report["open_loop"]["duration_s"] == DURATION_S and report["machine"]["cores"] >= 1
    rows = report["rates"]
    assert [row["rate"] for row in rows] == list(RATES)
    frames_seconds = QUICK.audio_frames / 12.5
    for row in rows:
        scheduled = len(arrival_times(row["rate"], DURATION_S, SEED))
        assert scheduled >= 2  # the seed gives each rate a few requests
        assert row["arrivals"] == row["sent"] == row["completed"] == row["requests"] == scheduled
        assert row["failed_by_code"] == {} and row["failed"] == 0 and row["not_started"] == 0
        assert row["achieved_rate"] == pytest.approx(scheduled / DURATION_S)
        assert 0 < row["ttft_p50"] and 0 < row["ttfa_p50"] <= row["ttfa_p95"] <= row["ttfa_p99"]
        assert 1 <= row["concurrency"] <= scheduled  # the most in flight at once
        assert row["ran_dry"] is not None and 0 <= row["ran_dry"] <= scheduled
        assert frames_seconds - 1 / 12.5 < row["audio_s_per_request"] <= frames_seconds
        assert row["requests_per_s"] > 0
        assert row["audio_s_per_s"] == pytest.approx(row["requests_per_s"] * row["audio_s_per_request"])
        assert row["passes"] == (row["verdict"] is None) == (row["ran_dry"] == 0)
        assert row["server_cpu_pct"]["tritonserver"] > 0  # a server on this machine: its CPU per rate
    goodput = report["goodput"]
    assert goodput["tried"] == [[row["rate"], row["passes"]] for row in rows]
    passing = [row["rate"] for row in rows if row["passes"]]
    assert goodput["requests_per_s"] == (max(passing) if passing else None)
    table = (out / "results.md").read_text()
    assert "Goodput:" in table and "| server | 0.5 |" in table and "| server | 1 |" in table
    if not any("plot skipped" in note for note in report["notes"]):
        assert (out / "open_loop.png").is_file()


def test_stop_after_fail_skips_the_rates_after_the_first_failing_one(triton_server, tiny_checkpoint, tmp_path):
    out = tmp_path / "stopped"
    # a limit no request meets: the first rate fails, so the second is not run
    main(["--url", triton_server.grpc_url, "--checkpoint", str(tiny_checkpoint), "--quick", "--warmup", "0",
          "--request-rate", "0.5,1", "--duration", "2", "--arrival-seed", str(SEED), "--ttfa-p95-limit-ms", "0.001",
          "--stop-after-fail", "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    assert [row["rate"] for row in report["rates"]] == [0.5] and not report["rates"][0]["passes"]
    assert report["goodput"]["requests_per_s"] is None
    assert any("--stop-after-fail: 0.5/s failed, so 1/s were not run" in note for note in report["notes"])
