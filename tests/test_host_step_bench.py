"""benchmarks/host_step_bench.py: the scheduler's and the sampler's host work per decode step, no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from host_step_bench import main, running_sequences  # noqa: E402


def test_every_running_sequence_is_a_one_token_decode_row():
    scheduler, seqs = running_sequences(5)
    batch = scheduler.schedule()
    assert batch.seqs == seqs and batch.num_new_tokens == [1] * 5 and not scheduler.waiting


def test_main_prints_a_row_per_row_count_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["host_step_bench.py", "--rows", "1,3", "--calls", "3", "--repeat", "2",
                                      "--out-dir", str(tmp_path)])
    main()
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "| 3 |" in printed
    report = json.loads((tmp_path / "host_step.json").read_text())
    assert [r["rows"] for r in report["results"]] == [1, 3]
    assert all(r["schedule_us"] > 0 and r["sampler_prepare_us"] > 0 for r in report["results"])
