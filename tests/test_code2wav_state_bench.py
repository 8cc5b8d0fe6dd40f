"""benchmarks/code2wav_state_bench.py on the tiny config on the CPU: its table, and the profile of one stateful call
(``--profile-batch``) that says where a code2wav call's time goes (the full-size run is a device command)."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_script


def test_the_bench_writes_its_table_and_the_profile_of_one_call(tmp_path):
    bench = load_script("code2wav_state_bench")
    bench.main(["--config", "tiny", "--batch-sizes", "1", "--chunk-frames", "4", "--profile-batch", "2",
                "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "code2wav_state_bench.json").read_text())
    assert [row["batch"] for row in result["rows"]] == [1] and result["rows"][0]["stateful_ms"] > 0
    profile = (tmp_path / "code2wav_profile.txt").read_text()
    assert profile.startswith("One stateful call, batch 2, 4 new frames a stream")
    assert "convolution" in profile and "self_cpu_time_total" in profile  # the vocoder's convs, CPU time
    # which convolution is which: the second table groups by input shapes, [batch, channels, ...] of each conv
    by_shape = profile.split("by input shapes")[1]
    assert "[[2, " in by_shape and "convolution" in by_shape
    assert result["cudnn_autotune"] == "off"
    assert "cuDNN autotune off" in (tmp_path / "code2wav_state_bench.md").read_text()


def test_a_profile_batch_below_one_is_refused():
    bench = load_script("code2wav_state_bench")
    with pytest.raises(SystemExit):
        bench.main(["--config", "tiny", "--profile-batch", "0"])
