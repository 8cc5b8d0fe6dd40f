"""benchmarks/code2wav_state_bench.py on the tiny config on the CPU: its table, and the profile of one stateful call
(``--profile-batch``) that says where a code2wav call's time goes (the full-size run is a device command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from benchmark_scripts import load_script

SWITCHES = Path(__file__).resolve().parents[1] / "benchmarks" / "code2wav_switches.sh"


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


def test_the_switches_script_benches_each_combination_and_tables_the_ratios(tmp_path):
    """benchmarks/code2wav_switches.sh on the CPU (the switches change nothing there): one combination's bench packed
    into its .tgz with the md/json, profile and log, and the table of ms per call with its ratio to the first."""
    # the script runs python3: this interpreter's, as on the device machine
    env = dict(os.environ, DEVICE="cpu", CONFIG="tiny", DTYPE="float32", BATCHES="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(SWITCHES), str(tmp_path), "base:off,off,off"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "base (autotune off, phases off, snake off): exit 0" in done.stdout
    with tarfile.open(tmp_path / "base.tgz") as packed:
        names = set(packed.getnames())
    assert {"base/code2wav_state_bench.json", "base/code2wav_profile.txt", "base/bench.log"} <= names
    table = (tmp_path / "switches.md").read_text()
    assert "| base | 1 | " in table and table.rstrip().endswith("| 1.00 | - |")  # no graphs on the CPU


def test_the_switches_script_refuses_a_value_that_is_not_on_or_off(tmp_path):
    done = subprocess.run(["bash", str(SWITCHES), str(tmp_path), "x:on,yes,off"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "takes on/off each, got 'yes'" in done.stderr


def test_the_switches_script_refuses_a_name_the_device_would_not_return(tmp_path):
    """A device call returns no file whose name has a ``+`` (a run's phases+snake.tgz was dropped so)."""
    done = subprocess.run(["bash", str(SWITCHES), str(tmp_path), "phases+snake:off,on,on"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "got 'phases+snake'" in done.stderr
    assert not list(tmp_path.iterdir())
