"""benchmarks/graph_timeline.py's reading of a replayed step's kernels (the profiling itself needs a GPU)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def timeline():
    return load_script("graph_timeline")


def test_busy_time_counts_overlapping_kernels_once(timeline):
    # under dependent launch a kernel starts before the previous one ends: overlap counts once, gaps not at all
    kernels = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 20.0, 25.0), ("d", 21.0, 23.0)]
    assert timeline.busy_us(kernels) == 17.0
    summary = timeline.summarize("step", kernels)
    assert (summary["kernels"], summary["span_us"], summary["busy_us"]) == (4, 25.0, 17.0)
    assert [row["name"] for row in summary["top"]] == ["a", "b", "c", "d"]


def test_a_talker_frame_splits_where_the_code_predictor_starts(timeline):
    # the predictor's first kernel is the qkv GEMV right before its first frame attention
    frame = [("_rms_norm_kernel", 0, 1), ("_gemv_kernel", 1, 2), ("_sample_rows_kernel", 2, 3),
             ("_gemv_kernel", 3, 4), (timeline.PREDICTOR_MARK, 4, 5), ("_gemv_kernel", 5, 6)]
    talker, predictor = timeline.split_talker(frame)
    assert [k[0] for k in talker] == ["_rms_norm_kernel", "_gemv_kernel", "_sample_rows_kernel"]
    assert predictor[0] == ("_gemv_kernel", 3, 4) and len(predictor) == 3
    assert timeline.split_talker(frame[:3]) == (frame[:3], [])
