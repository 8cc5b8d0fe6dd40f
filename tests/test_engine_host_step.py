"""benchmarks/engine_host_step.py: the engine's host time per decode step over stub models, on the fast path's
host code emulated on the CPU (device samplers, decode graphs, overlapped steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from engine_host_step import main  # noqa: E402


def test_main_prints_a_row_per_stage_and_row_count_and_writes_json(tmp_path, capsys):
    main(["--rows", "1,3", "--steps", "5", "--repeat", "1", "--out-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| thinker | 3 |" in printed and "| talker | 1 |" in printed
    report = json.loads((tmp_path / "engine_host_step.json").read_text())
    assert [(r["stage"], r["rows"]) for r in report["results"]] == [("thinker", 1), ("thinker", 3), ("talker", 1),
                                                                     ("talker", 3)]
    assert all(r["step_us"] > 0 and r["launch"] > 0 and r["finish"] > 0 for r in report["results"])


def test_a_baseline_tree_runs_beside_this_one(tmp_path, capsys):
    this_tree = Path(__file__).resolve().parents[1]
    main(["--rows", "2", "--stages", "talker", "--steps", "5", "--repeat", "1", "--rounds", "1",
          "--baseline-tree", str(this_tree), "--out-dir", str(tmp_path)])
    assert "| talker | 2 |" in capsys.readouterr().out
    report = json.loads((tmp_path / "engine_host_step.json").read_text())
    assert len(report["base"]) == len(report["branch"]) == 1


def test_admissions_time_the_add_its_prefill_steps_and_a_steady_step(tmp_path, capsys):
    main(["--rows", "2", "--admissions", "3", "--repeat", "1", "--out-dir", str(tmp_path)])
    assert "| talker admissions | 2 |" in capsys.readouterr().out
    (result,) = json.loads((tmp_path / "engine_host_step.json").read_text())["results"]
    assert result["add_us"] > 0 and result["prefill_steps_us"] > 0 and result["steady_step_us"] > 0
