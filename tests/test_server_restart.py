"""`omni-triton serve` brings tritonserver back after a native crash (a backend segfault takes the whole
process down) and after a stub process dies (Triton 2.51 never restarts one): both seen with the bundled
Triton 2.51 Python backend under load on a GPU (benchmarks/bls_gpu_repro, benchmarks/results/h200-served)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_triton.client import OmniStreamClient
from omni_triton.launch.tritonserver import free_port

pytestmark = pytest.mark.reliability


def _wait_for(log: Path, text: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert process.poll() is None, f"serve exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_restarts_after_a_crash_or_a_dead_stub_and_cleans_up(tiny_checkpoint, tmp_path):
    grpc_port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "omni_triton.cli", "serve", "--checkpoint", str(tiny_checkpoint),
               "--run-dir", str(tmp_path / "run"), "--grpc-port", str(grpc_port), "--http-port", str(free_port()),
               "--metrics-port", str(free_port()), "--kv-cache-tokens", "512", "--max-restarts", "2"]
    with open(log, "wb") as out:
        serve = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(log, "ready in", 180, serve)
        [tritonserver] = _children(serve.pid)
        stubs = _children(tritonserver)
        shm_prefix = f"omni{serve.pid}_{grpc_port}_"
        assert stubs and list(Path("/dev/shm").glob(f"{shm_prefix}*"))

        crashed_at = time.monotonic()
        os.kill(tritonserver, signal.SIGSEGV)  # what a native crash in a backend does to the server
        _wait_for(log, "ready again after restart 1", 180, serve)
        print(f"\nback {time.monotonic() - crashed_at:.1f} s after the crash")

        assert not [pid for pid in stubs if Path(f"/proc/{pid}").exists()], "stubs of the crashed server live on"
        with OmniStreamClient(f"127.0.0.1:{grpc_port}") as client:
            result = client.stream("After the crash", timeout_s=60, max_tokens=4, max_audio_frames=4,
                                   temperature=0.0)
        assert result.text and result.audio.size

        # a stub that dies (here the orchestrator's) leaves its model answering nothing: restart too
        [tritonserver] = _children(serve.pid)
        orchestrator = next(pid for pid in _children(tritonserver)
                            if "/orchestrator/1/model.py" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(orchestrator, signal.SIGKILL)
        _wait_for(log, "ready again after restart 2", 180, serve)
        assert "the stub process of ['orchestrator_0_0'] died" in log.read_text()  # its instance, named
        with OmniStreamClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.stream("After the stub died", timeout_s=60, max_tokens=4, max_audio_frames=4,
                                 temperature=0.0).audio.size

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not list(Path("/dev/shm").glob(f"{shm_prefix}*")), "shared memory left behind"
    finally:
        _stop(serve)


def _stop(serve: subprocess.Popen) -> None:
    """Stop serve and the tritonserver it runs, also when the test failed half-way: SIGINT first (serve then
    stops its server and cleans up), else SIGKILL to both (the server has a process group of its own)."""
    if serve.poll() is not None:
        return
    serve.send_signal(signal.SIGINT)
    try:
        serve.wait(60)
        return
    except subprocess.TimeoutExpired:
        pass
    for tritonserver in _children(serve.pid):
        try:
            os.killpg(tritonserver, signal.SIGKILL)
        except ProcessLookupError:
            pass
    serve.kill()
    serve.wait()
