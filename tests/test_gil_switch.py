"""serve --gil-switch-interval-ms: every stage process's GIL switch interval, from the flag to the stub that sets it,
and the probe that shows why (benchmarks/gil_switch_probe.py: a thread back from a GIL-released wait waits up to
the interval for a busy thread to hand the GIL over)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load_script
from omni_triton import cli
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.stages.model_args import prepare_stage_process
from server_fixture import rendered_settings


@pytest.fixture
def kept_switch_interval():
    previous = sys.getswitchinterval()
    yield
    sys.setswitchinterval(previous)


def settings_of(checkpoint: Path, *flags: str) -> LaunchConfig:
    args = cli.build_parser().parse_args(["serve", *flags])
    return LaunchConfig(checkpoint_dir=checkpoint, **{
        name: value for name, value in flag_settings(args).items() if name == "gil_switch_interval_ms"})


def test_the_flag_reaches_every_stage(tiny_checkpoint, tmp_path):
    assert settings_of(tiny_checkpoint).gil_switch_interval_ms is None  # Python's own unless asked
    config = settings_of(tiny_checkpoint, "--gil-switch-interval-ms", "0.5")
    out = render_repository(config, tmp_path / "repository", list(STAGES))
    assert {stage: rendered_settings(out, stage).gil_switch_interval_ms for stage in STAGES} == dict.fromkeys(
        STAGES, 0.5)


@pytest.mark.parametrize("value", [0.0, -1.0, 2000.0])
def test_an_interval_out_of_range_is_refused_naming_the_setting(tiny_checkpoint, value):
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, gil_switch_interval_ms=value)


def test_a_stage_process_takes_the_interval(tiny_checkpoint, kept_switch_interval):
    sys.setswitchinterval(0.005)
    prepare_stage_process(LaunchConfig(checkpoint_dir=tiny_checkpoint), "talker")
    assert sys.getswitchinterval() == pytest.approx(0.005)  # not set: left as Python has it
    prepare_stage_process(LaunchConfig(checkpoint_dir=tiny_checkpoint, gil_switch_interval_ms=0.5), "talker")
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_the_probe_reports_each_interval_and_restores_the_process(tmp_path, capsys, kept_switch_interval):
    probe = load_script("gil_switch_probe")
    sys.setswitchinterval(0.005)
    assert probe.main(["--intervals-ms", "5,0.5", "--cycles", "3", "--repeat", "1", "--wait-ms", "0.5",
                       "--work-us", "50", "--out-dir", str(tmp_path)]) == 0
    result = (tmp_path / "gil_switch_probe.json").read_text()
    rows = json.loads(result)["rows"]
    assert [row["interval_ms"] for row in rows] == [5.0, 0.5]
    assert all(row["alone_ms"] > 0 and row["beside_busy_ms"] > 0 for row in rows)
    assert "| 0.5 |" in capsys.readouterr().out
    assert sys.getswitchinterval() == pytest.approx(0.005)  # the probe leaves the process as it found it


def test_the_probe_refuses_bad_intervals():
    with pytest.raises(SystemExit):
        load_script("gil_switch_probe").main(["--intervals-ms", "5,zero"])
