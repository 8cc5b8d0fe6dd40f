"""serve --mps: which CUDA MPS control daemon the stages use, and that ours is started and told to quit; several
servers side by side, each pinned to its GPUs with CUDA_VISIBLE_DEVICES, each with a daemon that sees them.

The control binary is a stand-in script here (no GPU on this machine) that logs how it was called; the real
daemon runs under the served GPU sweeps (benchmarks/results/)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_triton.launch.mps import MpsError, reap_orphans, start_mps
from omni_triton.launch.tritonserver import ServerOptions, TritonInstall, TritonServer

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


# -- several servers on one host, each pinned to its GPUs (CUDA_VISIBLE_DEVICES) ------------------------------

FAKE_DAEMON = """#!/bin/bash
# Stand-in for nvidia-cuda-mps-control: "-d" leaves a process named like the real daemon, holding this
# environment (its pipe directory and CUDA_VISIBLE_DEVICES), and a control socket; "quit" on stdin ends both.
if [ "$1" = "-d" ]; then
    visible=${{CUDA_VISIBLE_DEVICES-unset}}
    echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY visible=$visible" >> "{log}"
    (exec -a nvidia-cuda-mps-control bash -c 'while :; do sleep 1; done' -d) </dev/null >/dev/null 2>&1 &
    # as the real one, return once the daemon runs: until its exec, /proc shows it as bash (no daemon found)
    for _ in $(seq 500); do
        tr '\\0' ' ' < /proc/$!/cmdline 2>/dev/null | grep -q '^nvidia-cuda-mps-control ' && break
        sleep 0.01
    done
    echo $! > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"
    echo $! >> "{log}.pids"
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"
    exit 0
fi
read -r command
echo "$command pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "{log}"
if [ "$command" = quit ]; then
    kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")" && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
"""

# Stand-in for tritonserver: writes the environment it was started with, then waits to be stopped.
FAKE_TRITONSERVER = """#!{python}
# as tritonserver does, SIGINT ends it whatever its parent ignored (a suite run in the background ignores SIGINT,
# and a stand-in that kept that waited out every stop's escalation: 80 s for this test)
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
with open(f"{out}/{{os.getpid()}}.env", "w") as env:
    env.write("".join(f"{{name}}={{value}}\\n" for name, value in os.environ.items()))
time.sleep(600)
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_daemon(tmp_path):
    """(the stand-in control binary, the log of its calls); whatever daemon a failed test left is ended."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    yield _script(bin_dir / "nvidia-cuda-mps-control", FAKE_DAEMON.format(log=log)), log
    pids = Path(f"{log}.pids")
    for pid in pids.read_text().split() if pids.exists() else ():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"nvidia-cuda-mps-control"):
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass  # gone already


def daemon_running(pipe: Path) -> bool:
    """Whether the daemon started in ``pipe`` still runs (a process killed but not yet reaped does not)."""
    pid = (pipe / "daemon.pid").read_text().strip() if (pipe / "daemon.pid").exists() else None
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_host_daemon(binary: Path, pipe: Path, visible: str | None) -> None:
    """A host-wide daemon someone else started (with its own CUDA_VISIBLE_DEVICES, or none)."""
    pipe.mkdir()
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), **({"CUDA_VISIBLE_DEVICES": visible}
                                                                              if visible is not None else {})}
    subprocess.run([str(binary), "-d"], env=env, check=True, timeout=30)


def test_two_servers_side_by_side_each_get_a_daemon_on_their_own_gpus(tmp_path, fake_daemon, monkeypatch):
    """The failure this prevents: a daemon started with CUDA_VISIBLE_DEVICES=1 numbers that GPU 0; a
    tritonserver still given CUDA_VISIBLE_DEVICES=1 asks it for a second GPU and finds none."""
    binary, log = fake_daemon
    out = tmp_path / "envs"
    out.mkdir()
    stand_in = _script(tmp_path / "tritonserver", FAKE_TRITONSERVER.format(out=out, python=sys.executable))
    install = TritonInstall(binary=stand_in, backend_dir=tmp_path, lib_dirs=(), origin="explicit")
    install.__dict__["help_text"] = ""
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-host-daemon"))
    servers = []
    try:
        for gpu_id, grpc_port in (("0", 18001), ("1", 18011)):  # two `serve`s, as two shells would start them
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_id)
            options = ServerOptions(gpu=True, mps="auto", grpc_port=grpc_port, http_port=grpc_port - 1,
                                    metrics_port=grpc_port + 1)
            (tmp_path / gpu_id).mkdir()
            servers.append(TritonServer(tmp_path / gpu_id, install, options).start())
        envs = []
        for server in servers:
            env_file = out / f"{server.process.pid}.env"
            for _ in range(100):  # the stand-in writes it as it starts
                if env_file.exists() and env_file.read_text().endswith("\n"):
                    break
                time.sleep(0.05)
            envs.append(dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line))
        pipes = [Path(env["CUDA_MPS_PIPE_DIRECTORY"]) for env in envs]
        assert pipes[0] != pipes[1] and all(daemon_running(pipe) for pipe in pipes)
        assert all(len(str(pipe / "control")) < 100 for pipe in pipes), "a unix socket path must stay short"
        starts = log.read_text().splitlines()
        assert starts == [f"start pipe={pipes[0]} log={envs[0]['CUDA_MPS_LOG_DIRECTORY']} visible=0",
                          f"start pipe={pipes[1]} log={envs[1]['CUDA_MPS_LOG_DIRECTORY']} visible=1"]
        # each tritonserver sees its daemon's one GPU as GPU 0, by its position in the daemon's list (not unset:
        # torch counts GPUs through NVML, which reads CUDA_VISIBLE_DEVICES and knows nothing of MPS)
        assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "0"]
        assert [server.mps.note for server in servers] == [
            f"own control daemon on GPUs {gpu_id} (pipe {pipe})" for gpu_id, pipe in zip("01", pipes)]
    finally:
        for server in servers:
            server.stop()
    assert log.read_text().splitlines()[2:] == [f"quit pipe={pipe}" for pipe in pipes]
    assert not any(daemon_running(pipe) or pipe.exists() for pipe in pipes)


@pytest.mark.parametrize("host_visible, ours, joined, server_visible", [
    (None, "1", True, "1"),          # the host's daemon sees every GPU: our numbering stands
    ("0,1", "1", True, "1"),         # it sees ours: GPU 1 is its second one
    ("2,3", "3,2", True, "1,0"),     # ... renumbered from 0, in our order
    ("0", "1", False, None),         # it does not see ours: never join it
    ("0", None, False, None),        # an unpinned server wants every GPU; this daemon has one
])
def test_the_hosts_daemon_only_when_it_sees_our_gpus(tmp_path, fake_daemon, host_visible, ours, joined,
                                                     server_visible):
    binary, log = fake_daemon
    host_pipe = tmp_path / "host-pipe"
    start_host_daemon(binary, host_pipe, host_visible)
    env = {"PATH": f"{binary.parent}{os.pathsep}/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(host_pipe),
           **({"CUDA_VISIBLE_DEVICES": ours} if ours is not None else {})}
    daemon = start_mps("auto", gpu=True, environ=env)
    try:
        server_env = daemon.server_environment(env)
        if joined:
            assert daemon.own_directory is None and server_env["CUDA_MPS_PIPE_DIRECTORY"] == str(host_pipe)
            assert server_env["CUDA_VISIBLE_DEVICES"] == server_visible
            assert len(log.read_text().splitlines()) == 1, "no daemon of our own"
        else:
            own_pipe = Path(server_env["CUDA_MPS_PIPE_DIRECTORY"])
            assert own_pipe != host_pipe and daemon_running(own_pipe)
            # our daemon's one GPU by its position; unpinned, every GPU (unset)
            assert server_env.get("CUDA_VISIBLE_DEVICES") == (None if ours is None else "0")
            assert log.read_text().splitlines()[1].endswith(f"visible={ours or 'unset'}")
            assert f"sees GPUs {host_visible}, not all of" in daemon.note
    finally:
        daemon.stop()
    assert daemon_running(host_pipe), "the host's daemon is never stopped by us"


def test_a_daemon_that_cannot_be_read_serves_only_an_unpinned_server(tmp_path, fake_daemon):
    """Another user's or container's daemon: its socket is there, its process is not readable."""
    binary, log = fake_daemon
    host_pipe = tmp_path / "host-pipe"
    host_pipe.mkdir()
    (host_pipe / "control").touch()
    env = {"PATH": f"{binary.parent}{os.pathsep}/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(host_pipe)}
    assert start_mps("auto", gpu=True, environ=env).environment == {}
    pinned = start_mps("auto", gpu=True, environ={**env, "CUDA_VISIBLE_DEVICES": "1"})
    try:
        assert pinned.own_directory is not None and "cannot be shown to see CUDA_VISIBLE_DEVICES=1" in pinned.note
    finally:
        pinned.stop()


def test_a_daemon_left_by_a_killed_serve_is_quit_by_the_next_start(tmp_path, fake_daemon):
    binary, log = fake_daemon
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan, ours = tmp_path / f"omni-mps-{gone.pid}-abc", tmp_path / f"omni-mps-{os.getpid()}-def"
    for own in (orphan, ours):
        (own / "pipe").mkdir(parents=True)
        subprocess.run([str(binary), "-d"], env={"CUDA_MPS_PIPE_DIRECTORY": str(own / "pipe")}, check=True)
    assert reap_orphans(str(binary), root=tmp_path) == [orphan]
    assert log.read_text().splitlines()[2:] == [f"quit pipe={orphan / 'pipe'}"] and not orphan.exists()
    assert daemon_running(ours / "pipe"), "a running serve's daemon is left alone"


def test_a_server_that_fails_to_start_stops_its_daemon(tmp_path, fake_daemon, monkeypatch):
    binary, log = fake_daemon
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-host-daemon"))
    install = TritonInstall(binary=tmp_path / "missing-tritonserver", backend_dir=tmp_path, lib_dirs=(),
                            origin="explicit")
    install.__dict__["help_text"] = ""
    server = TritonServer(tmp_path, install, ServerOptions(gpu=True, mps="auto"))
    with pytest.raises(FileNotFoundError):
        server.start()
    calls = log.read_text().splitlines()
    assert calls[0].startswith("start ") and calls[1].startswith("quit ") and server.mps.own_directory is None
