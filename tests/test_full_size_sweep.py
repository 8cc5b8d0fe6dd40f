"""benchmarks/full_size_sweep.sh's served part stops the server it started: the device runs several parts one
after the other in one 10-minute call, and a part whose server outlived it cost the next part its ports and GPU
memory (on the H200 the part's SIGINT reached a subshell that ignores it, and its `wait` hung until the call's
timeout). Here the part serves the tiny checkpoint on the CPU with a short workload, as the device runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def three_free_ports() -> int:
    """A port whose next two are free too (the script's HTTP, gRPC and metrics ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65000:
            continue
        try:
            for port in (base, base + 1, base + 2):
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no three consecutive free ports")


def processes_naming(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.mark.server
def test_the_served_part_stops_its_server_and_exits(tiny_checkpoint, tmp_path):
    out = tmp_path / "sweep"
    env = {**os.environ, "PORT": str(three_free_ports()), "LEVELS": "1", "SEQ_LEVELS": "", "LEFT_CONTEXT": "default",
           "MODEL_ARGS": f"--device cpu --checkpoint {tiny_checkpoint}",
           "BENCH_ARGS": "--requests-per-level 1 --warmup 0 --prompt-tokens 8 --thinker-tokens 4 --audio-frames 8",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(["bash", "benchmarks/full_size_sweep.sh", "served", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the served part did not exit; left running: {processes_naming(str(out))}")
    finally:
        left = processes_naming(str(out))
        if left:  # never leave a server of this test behind, whatever failed: SIGINT to the launcher (it stops
            # tritonserver and removes the stubs' shared memory), then SIGKILL to what is still there
            serve = [int(line.split(":")[0]) for line in left if "omni_triton.cli serve" in line]
            subprocess.run(["kill", "-INT", *map(str, serve)], check=False)
            for _ in range(60):
                if not processes_naming(str(out / "served" / "run")):
                    break
                time.sleep(0.5)
            for line in processes_naming(str(out)):
                subprocess.run(["kill", "-KILL", line.split(":")[0]], check=False)
    serve_log = (out / "served" / "serve.log").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + serve_log[-2000:]
    assert left == [], left  # tritonserver, its stubs and the launcher are gone when the part returns
    assert "stopping tritonserver" in serve_log  # stopped by its SIGINT, not killed
    level = json.loads((out / "served" / "results.json").read_text())["results"]
    assert [(row["system"], row["concurrency"], row["requests"], row["failed"]) for row in level] == [
        ("server", 1, 1, 0)]
