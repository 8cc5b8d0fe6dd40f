"""benchmarks/layout_compare.py: GPU layouts' closed-loop runs and goodputs against one GPU (the runs:
multi_gpu_device.sh)."""

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


# -- open loop: goodput per layout (the runs: multi_gpu_device.sh MODE=goodput) -----------------------------------
# Each server's results.json is written the way `omni-triton bench --request-rate` writes it: its rate rows from
# the bench's own summarize_rate / verdict / to_dict, the header of a real CPU run's (tiny checkpoint, --quick).

DURATION_S = 10.0
SAMPLES = 24_000  # one second of audio per chunk


def _rate_row(rate: float, first_audio_s: float, *, completed: int = 10, failed: int = 0, dry_s: float = 0.0) -> dict:
    """One rate's row: ``completed`` requests with their first audio at ``first_audio_s`` (one of them with a gap
    of ``dry_s`` before its second chunk), ``failed`` refused ones, over a 10 s wall (completed / 10 requests/s)."""
    from omni_triton.bench.goodput import verdict
    from omni_triton.bench.metrics import RequestTiming
    from omni_triton.bench.open_loop import RateRun, summarize_rate

    def served(gap: float) -> RequestTiming:
        return RequestTiming(text_times=[first_audio_s / 2], total_s=first_audio_s + 1.0 + gap,
                             audio_chunks=[(first_audio_s, SAMPLES), (first_audio_s + 1.0 + gap, SAMPLES)])

    timings = [served(dry_s)] + [served(0.0)] * (completed - 1)
    timings += [RequestTiming(error="InferenceServerException: [StatusCode.UNAVAILABLE] full",
                              error_code="UNAVAILABLE", total_s=0.01)] * failed
    row = summarize_rate("server", rate, DURATION_S, RateRun(timings, [0.001] * len(timings), 0, 0, 3, 10.0))
    row.verdict = verdict(row)
    return row.to_dict()


def _open_loop_run(run_dir: Path, *rows: dict, partial: bool = False, limit_s: float = 0.5) -> Path:
    from omni_triton.bench.goodput import highest_passing
    from omni_triton.bench.report import write_json

    tried = [(row["rate"], row["passes"]) for row in rows]
    report = {
        "label": run_dir.name, "machine": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu"},
        "command": f"omni-triton bench --url 127.0.0.1:18001 --device cpu --checkpoint checkpoints/tiny --quick "
                   f"--systems server --request-rate {','.join(f'{rate:g}' for rate, _ in tried)} --duration 10 "
                   f"--drain-timeout 30 --label {run_dir.name} --out {run_dir}",
        "workload": {"prompt_tokens": 16, "thinker_tokens": 16, "audio_frames": 25, "warmup_requests": 1,
                     "seed": 1234, "prompt_text": "please tell me a calm story about a"},
        "prompt_ids": 24, "gpu_memory_used_gib_at_start": None,
        "weights": {"checkpoint": "checkpoints/tiny", "load_format": "safetensors", "seed": 0},
        "open_loop": {"system": "server", "duration_s": DURATION_S, "arrival_seed": 0, "max_client_streams": 512,
                      "drain_timeout_s": 30.0, "late_start_s": 0.05},
        "goodput": {"system": "server", "requests_per_s": highest_passing(dict(tried)), "ttfa_p95_limit_s": limit_s,
                    "tried": tried, "search": None},
        "rates": list(rows), "notes": ["server: KV cache: 16384 tokens per engine"]}
    run_dir.mkdir()
    write_json(run_dir / "results.json", {**report, "partial": True} if partial else report)
    return run_dir


def _reports(*run_dirs: Path) -> list[dict]:
    return [json.loads((run_dir / "results.json").read_text()) for run_dir in run_dirs]


def test_servers_side_by_side_pass_a_rate_only_where_every_server_passed_it(layouts, tmp_path):
    one = _open_loop_run(tmp_path / "one", _rate_row(4, 0.2, completed=4), _rate_row(6, 0.3, completed=6),
                         _rate_row(8, 0.7, completed=7))
    a = _open_loop_run(tmp_path / "one-of2-rates", _rate_row(4, 0.2, completed=4), _rate_row(6, 0.3, completed=6),
                       _rate_row(8, 0.4, completed=8))
    b = _open_loop_run(tmp_path / "side1-of2-rates", _rate_row(4, 0.2, completed=4),
                       _rate_row(6, 0.2, completed=6, dry_s=0.2), _rate_row(8, 0.45, completed=8))
    pipes = _open_loop_run(tmp_path / "pipelines2", _rate_row(8, 0.3, completed=8), _rate_row(12, 0.4, completed=12),
                           _rate_row(16, 0.3, completed=15, failed=1))
    result = layouts.compare_goodput(
        [layouts.Layout("one GPU", 1, (one,)), layouts.Layout("2 servers side by side", 2, (a, b)),
         layouts.Layout("one server, --pipelines 2", 2, (pipes,))], [_reports(one), _reports(a, b), _reports(pipes)])
    rows = {(row["layout"], row["rate"]): row for row in result["rows"]}
    six = rows["2 servers side by side", 12]  # each server at 6/s: one of them had a stream dry
    assert six["rate_per_gpu"] == 6 and six["requests_per_s"] == pytest.approx(1.2)
    assert six["completed"] == 12 and six["ran_dry"] == 1 and not six["passes"]
    assert list(six["verdicts"]) == ["side1-of2-rates"] and "ran dry" in six["verdicts"]["side1-of2-rates"]
    assert rows["2 servers side by side", 16]["passes"]  # both passed at 8/s: the worst server's TTFA p95 450 ms
    assert rows["2 servers side by side", 16]["ttfa_p95"] == pytest.approx(0.45)
    goodputs = {goodput["layout"]: goodput for goodput in result["goodputs"]}
    assert goodputs["one GPU"]["requests_per_s"] == 6 and not goodputs["one GPU"]["at_ceiling"]
    side = goodputs["2 servers side by side"]  # 8 of each passed, 6 did not: not monotone, still the highest pass
    assert side["requests_per_s"] == 16 and side["per_gpu"] == 8 and side["at_ceiling"]
    assert side["x_reference"] == pytest.approx(16 / 6) and side["x_reference_bound"] == "lower"
    pipelines = goodputs["one server, --pipelines 2"]  # a refused request fails 16/s
    assert pipelines["requests_per_s"] == 12 and pipelines["x_reference"] == pytest.approx(2.0)
    assert pipelines["x_reference_bound"] == "exact" and pipelines["tried"] == [[8, True], [12, True], [16, False]]
    table = layouts.goodput_markdown(result)
    assert ("| 2 servers side by side | 2 | 12 | 6 | 1.20 | 300 / 300 | 1 of 12 | 0 of 12 | no: side1-of2-rates: "
            "1 ran dry (> 50 ms) |") in table
    assert ("| one server, --pipelines 2 | 2 | 16 | 8 | 1.50 | 300 / 300 | 0 of 15 | 1 of 16 | no: pipelines2: "
            "1 failed |") in table
    assert "| 2 servers side by side | 2 | >= 16 | >= 8 | >= 2.67 | 8 pass, 12 fail, 16 pass |" in table
    assert "| one GPU | 1 | 6 | 6 | 1.00 | 4 pass, 6 pass, 8 fail |" in table


def test_a_rate_a_cut_bench_did_not_reach_is_left_out_and_said(layouts, tmp_path):
    one = _open_loop_run(tmp_path / "one", _rate_row(1, 0.2), _rate_row(2, 0.3))
    a = _open_loop_run(tmp_path / "a", _rate_row(1, 0.2), _rate_row(2, 0.3))
    b = _open_loop_run(tmp_path / "b", _rate_row(1, 0.2), partial=True)  # its timeout came during 2/s
    result = layouts.compare_goodput([layouts.Layout("one GPU", 1, (one,)), layouts.Layout("two", 2, (a, b))],
                                     [_reports(one), _reports(a, b)])
    assert [row["rate"] for row in result["rows"] if row["layout"] == "two"] == [2]
    two = result["goodputs"][1]
    assert two["requests_per_s"] == 2 and two["at_ceiling"] and two["x_reference"] == pytest.approx(1.0)
    assert two["x_reference_bound"] == "unknown"  # both passed every rate they ran: neither goodput is bounded
    assert result["notes"] == ["two: b was cut short (measured: 1/s)",
                               "two: rate(s) 2/s per server left out: not every server measured them"]
    table = layouts.goodput_markdown(result)
    assert "| two | 2 | >= 2 | >= 1 | ? 1.00 | 2 pass |" in table and "- two: b was cut short" in table


def test_a_layout_that_passed_no_rate_has_no_goodput_and_no_ratio(layouts, tmp_path):
    one = _open_loop_run(tmp_path / "one", _rate_row(2, 0.3))
    split = _open_loop_run(tmp_path / "split", _rate_row(4, 0.9))
    result = layouts.compare_goodput([layouts.Layout("one GPU", 1, (one,)), layouts.Layout("split", 2, (split,))],
                                     [_reports(one), _reports(split)])
    assert result["goodputs"][1]["requests_per_s"] is None and result["goodputs"][1]["x_reference"] is None
    assert "| split | 2 | none passed | - | - | 4 fail |" in layouts.goodput_markdown(result)
    assert "no: split: TTFA p95 900 ms > 500 ms" in layouts.goodput_markdown(result)


def test_main_writes_the_goodput_table_and_refuses_mixed_or_unlike_runs(layouts, tmp_path, capsys):
    one = _open_loop_run(tmp_path / "one", _rate_row(1, 0.2), _rate_row(2, 0.6))
    side = _open_loop_run(tmp_path / "side1", _rate_row(1, 0.2), _rate_row(2, 0.3))
    out = tmp_path / "layouts.json"
    assert layouts.main(["--layout", f"one GPU:1:{one}", "--layout", f"2 servers:2:{one},{side}",
                         "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 2 servers | 2 | 2 | 1 | 2.00 | 2 pass, 4 fail |" in printed  # one's 2/s failed: so did 4 together
    assert [goodput["requests_per_s"] for goodput in json.loads(out.read_text())["goodputs"]] == [1, 2]

    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "results.json").write_text(json.dumps(_report((64, 8.0, 1.0, 0))))
    assert layouts.main(["--layout", f"one GPU:1:{one}", "--layout", f"closed:1:{closed}"]) == 1
    assert "do not compare" in capsys.readouterr().err
    strict = _open_loop_run(tmp_path / "strict", _rate_row(1, 0.2), limit_s=0.3)
    assert layouts.main(["--layout", f"one GPU:1:{one}", "--layout", f"strict:1:{strict}"]) == 1
    assert "TTFA p95 limits differ" in capsys.readouterr().err
