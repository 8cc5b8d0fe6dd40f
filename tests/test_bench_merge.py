"""`omni-triton bench --merge`: runs of one sweep split over several commands become one report. Pure: synthetic
results.json files, no server."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from omni_triton.bench.cli import main
from omni_triton.bench.merge import MergeError, merge
from omni_triton.bench.metrics import LevelSummary

WORKLOAD = {"prompt_tokens": 100, "thinker_tokens": 100, "audio_frames": 250, "concurrencies": [1, 4],
            "requests_per_level": 2, "warmup_requests": 1, "seed": 1234, "prompt_text": "please tell me"}
MACHINE = {"cpu": "Intel Xeon", "cores": 16, "gpu": "NVIDIA H200", "load_average_1m_at_start": 0.5,
           "git_commit": "abc"}


def row(system: str, concurrency: int, ttfa: float, audio_s_per_s: float = 20.0, failed: int = 0) -> dict:
    return LevelSummary(
        system=system, concurrency=concurrency, requests=4, failed=failed, wall_s=10.0, ttft_p50=ttfa / 2,
        ttft_p95=ttfa / 2, ttft_p99=ttfa / 2, ttfa_p50=ttfa, ttfa_p95=ttfa * 1.5, ttfa_p99=ttfa * 2, rtf_mean=0.5,
        rtf_p95=0.6, audio_s_per_request=20.0, requests_per_s=0.4, audio_s_per_s=audio_s_per_s, continuity=1.0,
        gpu_memory_peak_gib=100.0).to_dict()


def write_run(path, rows: list[dict], *, workload=None, machine=None, notes=("server: KV 263k tokens",),
              command="omni-triton bench --concurrency 1,4") -> str:
    path.mkdir(parents=True)
    report = {"label": path.name, "command": command, "machine": {**MACHINE, **(machine or {})},
              "workload": {**WORKLOAD, **(workload or {})}, "prompt_ids": 112, "torch_threads": 1,
              "results": rows, "ratios_to": "server", "ratios": [], "gpu_memory_used_gib_at_start": 0.5,
              "weights": {"checkpoint": "checkpoints/dummy/qwen3_omni_30b_a3b", "load_format": "dummy", "seed": 0},
              "notes": list(notes)}
    (path / "results.json").write_text(json.dumps(report))
    return str(path)


@pytest.fixture
def two_runs(tmp_path):
    low = write_run(tmp_path / "low", [row("server", 1, 0.2), row("server", 4, 0.3)],
                    command="omni-triton bench --concurrency 1,4 --out low")
    high = write_run(tmp_path / "high", [row("server", 16, 0.5, 80.0), row("inprocess", 16, 1.0, 40.0),
                                         row("inprocess", 1, 0.3)],
                     workload={"concurrencies": [1, 16], "requests_per_level": 4},
                     machine={"load_average_1m_at_start": 3.0}, notes=("inprocess: KV 300k tokens",),
                     command="omni-triton bench --concurrency 1,16 --out high")
    return low, high


def test_merge_concatenates_rows_recomputes_ratios_and_keeps_every_command(two_runs, tmp_path):
    low, high = two_runs
    out = tmp_path / "merged"
    assert main(["--merge", low, high, "--out", str(out), "--label", "sweep"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["label"] == "sweep"
    # every row, ordered by system (server first) then concurrency
    assert [(r["system"], r["concurrency"]) for r in report["results"]] == [
        ("server", 1), ("server", 4), ("server", 16), ("inprocess", 1), ("inprocess", 16)]
    assert report["results"][0] == row("server", 1, 0.2)  # rows survive the round trip unchanged
    # ratios across runs: inprocess of `high` at 1 against server of `low` at 1
    ratios = {(r["system"], r["concurrency"]): r for r in report["ratios"]}
    assert set(ratios) == {("inprocess", 1), ("inprocess", 16)}
    assert ratios[("inprocess", 1)]["ttfa_p50"] == pytest.approx(1.5)
    assert ratios[("inprocess", 16)]["ttfa_p50"] == pytest.approx(2.0)
    assert ratios[("inprocess", 16)]["audio_s_per_s"] == pytest.approx(0.5)
    assert [(m["dir"], m["command"]) for m in report["merged_from"]] == [
        (low, "omni-triton bench --concurrency 1,4 --out low"), (high, "omni-triton bench --concurrency 1,16 --out high")]
    assert report["merged_from"][1]["machine"]["load_average_1m_at_start"] == 3.0
    assert report["notes"][:2] == [f"[{low}] server: KV 263k tokens", f"[{high}] inprocess: KV 300k tokens"]
    assert report["workload"]["concurrencies"] == [1, 4, 16]
    assert report["workload"]["requests_per_level"] == "2 / 4"  # allowed to differ, shown as such
    assert report["machine"]["gpu"] == "NVIDIA H200" and report["machine"]["load_average_1m_at_start"] == "0.5 / 3.0"
    table = (out / "results.md").read_text()
    assert "omni-triton bench --concurrency 1,4 --out low" in table
    assert "omni-triton bench --concurrency 1,16 --out high" in table
    assert "| inprocess | 16 |" in table


def test_a_merge_of_merges_lists_the_original_commands(two_runs, tmp_path):
    low, high = two_runs
    first = tmp_path / "first"
    assert main(["--merge", low, high, "--out", str(first)]) == 0
    third = write_run(tmp_path / "third", [row("server", 32, 0.9)], command="omni-triton bench --concurrency 32")
    assert main(["--merge", str(first), third, "--out", str(tmp_path / "all")]) == 0
    table = (tmp_path / "all" / "results.md").read_text()
    for command in ("--concurrency 1,4 --out low", "--concurrency 1,16 --out high", "--concurrency 32"):
        assert command in table


def test_a_failed_row_makes_the_exit_status_1(tmp_path):
    runs = [write_run(tmp_path / "a", [row("server", 1, 0.2)]), write_run(tmp_path / "b", [row("server", 4, 0.3,
                                                                                                  failed=1)])]
    assert main(["--merge", *runs, "--out", str(tmp_path / "out")]) == 1


def test_refuses_a_level_measured_twice(two_runs, tmp_path, capsys):
    low, _ = two_runs
    again = write_run(tmp_path / "again", [row("server", 4, 0.35)])
    assert main(["--merge", low, again, "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "server at concurrency 4 is in both" in error and low in error and again in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["prompt_tokens", "thinker_tokens", "audio_frames"])
def test_refuses_runs_of_another_workload(two_runs, tmp_path, field):
    low, _ = two_runs
    other = write_run(tmp_path / "other", [row("server", 8, 0.4)], workload={field: 25})
    with pytest.raises(MergeError, match=f"workload {field}: .*low: {WORKLOAD[field]}, .*other: 25"):
        merge([low, other], tmp_path / "out")


@pytest.mark.parametrize("field, value", [("gpu", "NVIDIA H100 80GB HBM3"), ("cpu", "AMD EPYC")])
def test_refuses_runs_on_another_machine(two_runs, tmp_path, field, value):
    low, _ = two_runs
    other = write_run(tmp_path / "other", [row("server", 8, 0.4)], machine={field: value})
    with pytest.raises(MergeError, match=f"machine {field}: .*{value}"):
        merge([low, other], tmp_path / "out")


def test_refuses_what_is_not_a_run(two_runs, tmp_path):
    low, high = two_runs
    with pytest.raises(MergeError, match="no such file"):
        merge([low, str(tmp_path / "missing")], tmp_path / "out")
    with pytest.raises(MergeError, match="overwrite"):
        merge([low, high], low)
    with pytest.raises(MergeError, match="at least two"):
        merge([low], tmp_path / "out")
    broken = write_run(tmp_path / "broken", [{**row("server", 8, 0.4), "ttfa_p42": 1.0}])
    with pytest.raises(MergeError, match=r"unknown \['ttfa_p42'\]"):
        merge([low, broken], tmp_path / "out")


def test_merge_needs_out_and_no_run_options(two_runs):
    low, high = two_runs
    with pytest.raises(SystemExit):
        main(["--merge", low, high])
    with pytest.raises(SystemExit):
        main(["--merge", low, high, "--out", "x", "--start-server"])


def test_level_summary_round_trips_through_its_dict():
    summary = LevelSummary.from_dict(row("server", 1, 0.2))
    assert summary.to_dict() == row("server", 1, 0.2)
    older = row("server", 1, 0.2)
    del older["gpu_memory_peak_gib"]  # results.json written before the field existed: its default
    assert LevelSummary.from_dict(older) == replace(summary, gpu_memory_peak_gib=None)
    missing = row("server", 1, 0.2)
    del missing["ttfa_p50"]
    with pytest.raises(ValueError, match=r"missing \['ttfa_p50'\]"):
        LevelSummary.from_dict(missing)
