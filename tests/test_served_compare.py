"""benchmarks/served_compare.py: two bench runs' results side by side (the runs themselves: fp8_device.sh)."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def compare():
    return load_script("served_compare")


def _level(concurrency: int, requests_per_s: float, ttfa_p95: float, ran_dry: int = 0, **fields) -> dict:
    return dict(system="server", concurrency=concurrency, requests=2 * concurrency, failed=0, ran_dry=ran_dry,
                requests_per_s=requests_per_s, audio_s_per_s=20 * requests_per_s, ttft_p50=0.1, ttfa_p50=0.5,
                ttfa_p95=ttfa_p95, gpu_memory_peak_gib=fields.get("gpu", 130.0))


def test_levels_pair_by_system_and_concurrency(compare):
    bf16 = {"results": [_level(8, 2.0, 1.5), _level(32, 5.0, 2.6), _level(64, 5.4, 3.6, ran_dry=5)]}
    fp8 = {"results": [_level(32, 7.5, 1.3), _level(64, 8.1, 1.8, ran_dry=1, gpu=100.0)]}
    result = compare.compare(bf16, fp8, ("bf16", "fp8"))
    assert [level["concurrency"] for level in result["levels"]] == [32, 64]  # 8: one run only
    at64 = result["levels"][1]
    assert at64["requests_per_s"] == {"base": 5.4, "other": 8.1, "ratio": pytest.approx(1.5)}
    assert at64["ttfa_p95"]["ratio"] == pytest.approx(0.5)
    assert at64["ran_dry"] == {"base": 5, "other": 1}
    assert result["goodput"] is None
    table = compare.markdown(result)
    assert "| server | 64 | 5.40 -> 8.10 (1.50x) | 108.00 -> 162.00 (1.50x) | 100 -> 100 (1.00x) | " in table
    assert "| 3600 -> 1800 (0.50x) | 130.00 -> 100.00 (0.77x) | 5 -> 1 | 0 -> 0 |" in table


def test_goodput_of_two_open_loop_runs(compare):
    def run(rate, tried):
        return {"rates": [], "goodput": {"requests_per_s": rate, "tried": tried}}
    result = compare.compare(run(2.0, [[2, True], [4, False], [3, False]]),
                             run(3.0, [[2, True], [4, False], [3, True]]), ("bf16", "fp8"))
    assert result["levels"] == []
    assert result["goodput"]["ratio"] == pytest.approx(1.5)
    assert "bf16 2.00, fp8 3.00 (1.50x); rates tried: bf16 2 pass, 4 fail, 3 fail; fp8 2 pass" in compare.markdown(result)
    none_passed = compare.compare(run(None, [[2, False]]), run(1.0, [[2, False], [1, True]]), ("bf16", "fp8"))
    assert none_passed["goodput"]["ratio"] is None
    assert "Goodput (requests/s): bf16 -, fp8 1.00; " in compare.markdown(none_passed)


def test_main_names_a_missing_run_and_writes_json(compare, tmp_path, capsys):
    for name, rate in (("bf16", 5.0), ("fp8", 6.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"results": [_level(32, rate, 2.0)]}))
    assert compare.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--labels", "bf16,fp8",
                         "--out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["levels"][0]["requests_per_s"]["ratio"] == pytest.approx(1.2)
    assert compare.main([str(tmp_path / "bf16"), str(tmp_path / "missing")]) == 1
    assert "missing/results.json: no such file" in capsys.readouterr().err
