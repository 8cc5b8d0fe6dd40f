"""serve --mps: which CUDA MPS control daemon the stages use, and that ours is started and told to quit.

The control binary is a stand-in script here (no GPU on this machine) that logs how it was called; the real
daemon runs under the served GPU sweeps (benchmarks/results/)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from omni_triton.launch.mps import MpsError, start_mps

FAKE_CONTROL = """#!/bin/sh
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat /dev/stdin 2>/dev/null | head -c 20)" >> "{log}"
exit {code}
"""


def fake_control(tmp_path: Path, exit_code: int = 0) -> tuple[dict[str, str], Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE_CONTROL.format(log=log, code=exit_code))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}, log


def test_off_or_no_gpu_uses_no_mps(tmp_path):
    env, log = fake_control(tmp_path)
    assert start_mps("off", gpu=True, environ=env).environment == {}
    assert start_mps("on", gpu=False, environ=env).note == "off (no GPU)"
    assert not log.exists(), "no daemon started"


def test_the_hosts_daemon_is_used_as_it_is(tmp_path):
    env, log = fake_control(tmp_path)
    pipe = tmp_path / "host-pipe"
    pipe.mkdir()
    (pipe / "control").touch()
    daemon = start_mps("auto", gpu=True, environ={**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    assert daemon.environment == {} and str(pipe) in daemon.note
    daemon.stop()
    assert not log.exists(), "the host's daemon is neither started nor stopped by us"


def test_an_own_daemon_gets_private_directories_and_quits_with_the_server(tmp_path):
    env, log = fake_control(tmp_path)
    daemon = start_mps("auto", gpu=True, environ=env)
    pipe, logs = Path(daemon.environment["CUDA_MPS_PIPE_DIRECTORY"]), daemon.environment["CUDA_MPS_LOG_DIRECTORY"]
    assert pipe.is_dir() and len(str(pipe / "control")) < 100, "a unix socket path must stay short"
    assert log.read_text().splitlines() == [f"args=-d pipe={pipe} log={logs} stdin="]
    daemon.stop()
    assert log.read_text().splitlines()[1] == f"args= pipe={pipe} log={logs} stdin=quit"
    assert not pipe.exists(), "its directories are removed"
    daemon.stop()  # a second stop is a no-op
    assert len(log.read_text().splitlines()) == 2


def test_no_mps_to_be_had_is_a_note_for_auto_and_an_error_for_on(tmp_path):
    env = {"PATH": str(tmp_path), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}
    assert "not found" in start_mps("auto", gpu=True, environ=env).note
    with pytest.raises(MpsError, match="--mps on: nvidia-cuda-mps-control not found"):
        start_mps("on", gpu=True, environ=env)
    failing, _ = fake_control(tmp_path, exit_code=3)
    assert "exited with 3" in start_mps("auto", gpu=True, environ=failing).note
    with pytest.raises(MpsError, match="exited with 3"):
        start_mps("on", gpu=True, environ=failing)
    with pytest.raises(MpsError, match="must be one of"):
        start_mps("sometimes", gpu=True, environ=env)
