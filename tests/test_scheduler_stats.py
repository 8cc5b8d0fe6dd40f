"""Triton's statistics per model over a level (bench.scheduler_stats): the counters read from the statistics
API's JSON, and a level's summary of them. A served bench level's (tests/test_bench_cli.py) reads a real server."""

from __future__ import annotations

import pytest

from omni_triton.bench.report import triton_models_table
from omni_triton.bench.scheduler_stats import SchedulerStats, level_summary, model_counters


def _stats(requests: int, executions: int, queue_ns: int, infer_ns: int, version: str = "1") -> dict:
    """A model's entry as tritonclient's as_json writes it: 64-bit counts as strings, zero kinds left out."""
    stats = {"queue": {"count": str(requests), "ns": str(queue_ns)},
             "compute_infer": {"count": str(requests), "ns": str(infer_ns)}}
    return {"name": "talker", "version": version, "inference_count": str(requests),
            "execution_count": str(executions), "inference_stats": stats}


def test_counters_read_strings_sum_versions_and_take_missing_kinds_as_zero():
    counters = model_counters({"model_stats": [_stats(10, 4, 50_000_000, 20_000_000),
                                               _stats(2, 1, 1_000_000, 0, version="2"),
                                               {"name": "thinker", "version": "1"}]})
    assert counters["talker"]["requests"] == 12 and counters["talker"]["executions"] == 5
    assert counters["talker"]["queue_ns"] == 51_000_000 and counters["talker"]["compute_output_count"] == 0
    assert counters["thinker"] == {"requests": 0, "executions": 0,
                                   **{f"{kind}_{unit}": 0 for kind in ("queue", "compute_input", "compute_infer",
                                                                        "compute_output") for unit in ("count", "ns")}}


def test_a_level_is_the_difference_of_two_readings_per_request():
    before = model_counters({"model_stats": [_stats(10, 4, 50_000_000, 20_000_000)]})
    after = model_counters({"model_stats": [_stats(30, 9, 90_000_000, 60_000_000),
                                            {**_stats(5, 5, 5_000_000, 5_000_000), "name": "loaded_between"}]})
    summary = level_summary(before, after)
    # 20 requests in 5 executions, 40 ms queued and 40 ms computed between them
    assert summary == {"talker": {"requests": 20, "executions": 5, "batch_mean": 4.0, "queue_ms": 2.0,
                                  "input_ms": None, "compute_ms": 2.0, "output_ms": None}}
    assert level_summary(after, after) == {}  # no request during the level: nothing to say


def test_the_table_has_a_row_per_model_and_level():
    summary = {"talker": {"requests": 20, "executions": 5, "batch_mean": 4.0, "queue_ms": 2.0, "input_ms": None,
                          "compute_ms": 1.25, "output_ms": None}}
    table = "\n".join(triton_models_table([("server", "64", summary), ("inprocess", "64", None)], "conc"))
    assert "| server | 64 | talker | 20 | 5 | 4.00 | 2.00 | 1.25 |" in table
    assert "inprocess" not in table
    assert triton_models_table([("inprocess", "1", None)], "conc") == []


@pytest.mark.parametrize("url", [None, "127.0.0.1:1"])  # no server, and one that cannot be reached
def test_no_server_means_no_statistics_not_a_failed_level(url):
    with SchedulerStats(url) as stats:
        pass
    assert stats.summary is None
