"""benchmarks/layout_compare.py: GPU layouts' closed-loop runs against one GPU (the runs: multi_gpu_device.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def layouts():
    return load_script("layout_compare")


def _report(*levels: tuple[int, float, float, int]) -> dict:
    return {"results": [dict(system="server", concurrency=c, requests=2 * c, failed=0, ran_dry=dry,
                             requests_per_s=rate, ttfa_p50=p50, ttfa_p95=2 * p50) for c, rate, p50, dry in levels]}


def test_servers_measured_together_are_summed_and_compared_per_gpu(layouts):
    one = layouts.Layout("one GPU", 1, (Path("one"),))
    side = layouts.Layout("two servers", 2, (Path("a"), Path("b")))
    pipes = layouts.Layout("two pipelines", 2, (Path("p"),))
    result = layouts.compare([one, side, pipes], [
        [_report((32, 8.0, 0.6, 0), (64, 8.5, 3.0, 2))],
        [_report((32, 7.5, 0.7, 1)), _report((32, 8.1, 0.9, 0))],  # both servers' level 32 ran at once
        [_report((64, 15.0, 0.8, 0), (128, 17.0, 2.5, 4))]])
    rows = {(row["layout"], row["streams"]): row for row in result["rows"]}
    together = rows["two servers", 64]
    assert together["streams_per_gpu"] == 32
    assert together["requests_per_s"] == pytest.approx(15.6)
    assert together["x_reference"] == pytest.approx(15.6 / 8.0)  # one GPU at 32 streams per GPU
    assert together["ttfa_p50"] == 0.9 and together["ran_dry"] == 1 and together["requests"] == 128
    assert rows["two pipelines", 128]["x_reference"] == pytest.approx(17.0 / 8.5)
    assert rows["one GPU", 32]["x_reference"] == 1.0
    table = layouts.markdown(result)
    assert "| two servers | 2 | 64 | 32 | 15.60 | 1.95 | 900 / 1800 | 1 of 128 | 0 |" in table


def test_a_level_one_gpu_did_not_measure_has_no_ratio(layouts):
    result = layouts.compare([layouts.Layout("one GPU", 1, (Path("one"),)), layouts.Layout("four", 4, (Path("f"),))],
                             [[_report((64, 8.0, 1.0, 0))], [_report((128, 20.0, 0.5, 0))]])
    assert result["rows"][1]["x_reference"] is None
    assert "| four | 4 | 128 | 32 | 20.00 | - |" in layouts.markdown(result)


@pytest.mark.parametrize("text", ["one GPU:1", "one GPU:x:dir", "one GPU:0:dir", ":1:dir", "name:2:"])
def test_a_malformed_layout_is_refused_naming_it(layouts, text):
    with pytest.raises(ValueError, match="--layout"):
        layouts.parse_layout(text)


def test_main_reports_a_missing_run_and_compares_the_rest(layouts, tmp_path, capsys):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "results.json").write_text(json.dumps(_report((64, 8.0, 1.0, 0))))
    status = layouts.main(["--layout", f"one GPU:1:{tmp_path / 'one'}",
                           "--layout", f"two servers:2:{tmp_path / 'one'},{tmp_path / 'gone'}",
                           "--out", str(tmp_path / "layouts.json")])
    captured = capsys.readouterr()
    assert status == 1
    assert "two servers" in captured.err and "gone" in captured.err
    assert json.loads((tmp_path / "layouts.json").read_text())["rows"][0]["layout"] == "one GPU"
