"""benchmarks/served_device_check.py's stream comparison: what shows that two placements serve the same streams."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def check():
    return load_script("served_device_check")


def stream(text: str, seed: int, samples: int = 480) -> SimpleNamespace:
    return SimpleNamespace(text=text, audio=np.random.default_rng(seed).standard_normal(samples).astype(np.float32))


def test_streams_saved_by_one_run_compare_equal_in_the_next(check, tmp_path):
    served = {1: [stream("hello", 0), stream("world", 1)], 8: [stream("again", 2)]}
    check.save_streams(tmp_path / "one.npz", served)
    report = check.compare_saved_streams(tmp_path / "one.npz", served, audio_atol=0.0)
    assert report == {1: {"streams": 2, "text_equal": 2, "audio_equal": 2, "audio_max_abs_diff": 0.0},
                      8: {"streams": 1, "text_equal": 1, "audio_equal": 1, "audio_max_abs_diff": 0.0}}


def test_a_different_stream_a_shorter_one_or_a_missing_one_counts_unequal(check, tmp_path):
    check.save_streams(tmp_path / "one.npz", {1: [stream("hello", 0), stream("world", 1)]})
    nudged = stream("hello", 0)
    nudged.audio[100] += 1e-3
    report = check.compare_saved_streams(tmp_path / "one.npz", {1: [nudged, stream("world", 1, samples=479)]},
                                         audio_atol=1e-4)
    assert report[1]["text_equal"] == 2 and report[1]["audio_equal"] == 0
    assert report[1]["audio_max_abs_diff"] == float("inf")  # the shorter stream has no sample-wise difference
    missing = check.compare_saved_streams(tmp_path / "one.npz", {1: [stream("x", 0), stream("y", 1), stream("z", 2)]},
                                          audio_atol=1e-4)
    assert missing[1] == {"streams": 3, "text_equal": 0, "audio_equal": 2, "audio_max_abs_diff": float("inf")}
