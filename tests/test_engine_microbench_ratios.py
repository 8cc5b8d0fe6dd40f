"""benchmarks/engine_microbench.py's comparison of quantizations (the timing itself: tiny CPU run in
benchmarks/README.md, full size on a GPU)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def microbench():
    return load_script("engine_microbench")


def _thinker(cases: dict[tuple[int, int], tuple[float, float]], variant: str = "pdl") -> dict:
    return {"rows": [dict(prompt_len=n, batch=b, variants={variant: dict(decode_ms=d, prefill_ms=p)})
                     for (n, b), (d, p) in cases.items()]}


def _talker(cases: dict[int, tuple[float, float]]) -> dict:
    return {"rows": [dict(batch=b, variants={"pdl": dict(frame_ms=f, prefill_ms=p)}) for b, (f, p) in cases.items()]}


def test_ratios_pair_the_same_step_case_and_variant(microbench):
    base = {"thinker": _thinker({(108, 1): (3.0, 12.0), (108, 64): (10.0, 80.0), (512, 1): (3.2, 18.0)}),
            "talker": _talker({1: (2.5, 5.0), 64: (5.5, 30.0)})}
    fp8 = {"thinker": _thinker({(108, 1): (2.4, 12.0), (108, 64): (5.5, 60.0)}),  # no 512-token case
           "talker": _talker({1: (3.0, 6.0), 64: (4.4, 27.0)})}
    ratios = microbench.quantization_ratios(base, fp8, "fp8")
    got = {(r["stage"], r["step"], r["prompt_len"], r["batch"]): (r["base_ms"], r["ms"], r["ratio"]) for r in ratios}
    assert got[("thinker", "decode", 108, 64)] == (10.0, 5.5, pytest.approx(0.55))
    assert got[("thinker", "prefill", 108, 64)] == (80.0, 60.0, pytest.approx(0.75))
    assert got[("talker", "frame", None, 1)] == (2.5, 3.0, pytest.approx(1.2))
    assert ("thinker", "decode", 512, 1) not in got  # measured by one run only
    assert {r["quantization"] for r in ratios} == {"fp8"}
    # grouped by step: every decode row before the prefill rows
    assert [(r["stage"], r["step"], r["batch"]) for r in ratios] == [
        ("thinker", "decode", 1), ("thinker", "decode", 64), ("thinker", "prefill", 1), ("thinker", "prefill", 64),
        ("talker", "frame", 1), ("talker", "frame", 64), ("talker", "prefill", 1), ("talker", "prefill", 64)]


def test_variants_only_one_run_measured_are_left_out(microbench):
    base = {"thinker": _thinker({(108, 1): (3.0, 12.0)}, variant="graphs")}
    other = {"thinker": _thinker({(108, 1): (2.0, 10.0)}, variant="pdl")}
    assert microbench.quantization_ratios(base, other, "fp8") == []
    assert microbench.quantization_ratios(base, {}, "fp8") == []


def test_ratio_table_has_a_column_per_quantization(microbench):
    base = {"thinker": _thinker({(108, 64): (10.0, 80.0)})}
    ratios = (microbench.quantization_ratios(base, {"thinker": _thinker({(108, 64): (5.5, 60.0)})}, "fp8")
              + microbench.quantization_ratios(base, {"thinker": _thinker({(108, 64): (6.0, 40.0)})}, "fp8-w8a8"))
    table = microbench.ratio_table(ratios, ["none", "fp8", "fp8-w8a8"])
    assert table[2] == "| step | batch | variant | none ms | fp8 ms (ratio) | fp8-w8a8 ms (ratio) |"
    assert "| thinker decode (~108 tokens) | 64 | pdl | 10.00 | 5.50 (0.55x) | 6.00 (0.60x) |" in table
    assert "| thinker prefill (~108 tokens) | 64 | pdl | 80.00 | 60.00 (0.75x) | 40.00 (0.50x) |" in table
    one_run = microbench.ratio_table(ratios[:2], ["none", "fp8", "fp8-w8a8"])
    assert "| thinker decode (~108 tokens) | 64 | pdl | 10.00 | 5.50 (0.55x) | - |" in one_run
