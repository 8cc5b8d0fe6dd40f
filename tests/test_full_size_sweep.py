"""benchmarks/full_size_sweep.sh's served part stops the server it started, and benchmarks/served_variants.sh packs
each such part under OUT as it ends: the device runs several parts one after the other in one 10-minute call, and
a part whose server outlived it cost the next part its ports and GPU memory (on the H200 the part's SIGINT reached
a subshell that ignores it, and its `wait` hung until the call's timeout, with nothing packed). Here the parts serve
the tiny checkpoint on the CPU with a short workload, as the device runs them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tarfile
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


STAND_IN_PYSPY = """#!/bin/sh
# stand-in for `py-spy record`: the profile file it was asked for, naming the process it was given
while [ $# -gt 0 ]; do case "$1" in --output) out=$2; shift ;; --pid) pid=$2; shift ;; esac; shift; done
echo "stand-in profile of $pid" > "$out"
"""


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


SHORT_WORKLOAD = "--prompt-tokens 8 --thinker-tokens 4 --audio-frames 8"


def variants_environment(checkpoint: Path, tmp_path: Path, **settings: str) -> dict[str, str]:
    """benchmarks/served_variants.sh's environment for a short CPU run, its work dir tmp_path/work."""
    (tmp_path / "work").mkdir()
    (tmp_path / "bin").mkdir()
    return {**os.environ, "PORT": str(three_free_ports()), "TMPDIR": str(tmp_path / "work"),
            "MODEL_ARGS": f"--device cpu --checkpoint {checkpoint}", "BUDGET_S": "200", "RUN_S": "60",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            # the scripts run `python3`: this interpreter's (the project's environment, activated or not)
            # and py-spy a stand-in (the real one needs ptrace rights a CI container may not give)
            "PATH": os.pathsep.join((str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ["PATH"])),
            **settings}


@pytest.mark.server
def test_each_served_variant_is_packed_as_it_ends_and_leaves_no_server(tiny_checkpoint, tmp_path):
    """benchmarks/served_variants.sh drives the sweep's served part once per variant: here one variant, its serve
    flag passed through, profiled by (a stand-in) py-spy; the part must exit by itself (not by the variants'
    timeout) with its server stopped by SIGINT, and its run packed under OUT at once, profile included."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = variants_environment(tiny_checkpoint, tmp_path, LEVELS="1", PYSPY="0 1 10",
                               BENCH_ARGS="--requests-per-level 1 --warmup 0 " + SHORT_WORKLOAD)
    stand_in = tmp_path / "bin" / "py-spy"
    stand_in.write_text(STAND_IN_PYSPY)
    stand_in.chmod(0o755)
    try:
        done = subprocess.run(["bash", "benchmarks/served_variants.sh", str(out), "one||--max-restarts 0",
                               "bad name||"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=260)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the variants did not end; left running: {processes_naming(str(work))}")
    finally:
        left = stop_what_is_left(str(work))
    summary = (out / "variants.txt").read_text()
    assert done.returncode == 2 and "a variant's name is letters" in done.stderr, done.stdout + done.stderr
    assert left == [], left  # tritonserver, its stubs and the launcher are gone when the part returns
    assert re.search(r"^one: exit 0 in \d+ s .*--max-restarts 0", summary, re.M), summary
    with tarfile.open(out / "one.tgz") as packed:
        names = set(packed.getnames())
        serve_log = packed.extractfile("one/served/serve.log").read().decode()
        level = json.loads(packed.extractfile("one/served/results.json").read())["results"]
        stubs = packed.extractfile("one/pyspy/stubs.txt").read().decode().splitlines()
        ours = [line.split()[0] for line in stubs if str(work) in line and "/thinker/1/model.py" in line]
        assert len(ours) == 1, stubs  # this run's thinker stub (other tests' servers may be running too)
        profile = packed.extractfile(f"one/pyspy/thinker-{ours[0]}.txt").read().decode()
    assert profile == f"stand-in profile of {ours[0]}\n"  # recorded while the run's server was up
    assert not any("/repository" in name for name in names), sorted(names)[:20]
    # the request traces come back too: the server's (its engines' step logs) and the level's client events
    assert any(name.startswith("one/served/trace/server/") for name in names), sorted(names)[:20]
    assert any(name.startswith("one/served/trace/server-c1/") for name in names), sorted(names)[:20]
    assert "stopping tritonserver" in serve_log  # stopped by the part's SIGINT, not killed by a timeout
    assert [(row["system"], row["concurrency"], row["requests"], row["failed"]) for row in level] == [
        ("server", 1, 1, 0)]
    assert "| server | 1 |" in summary  # the level's row, in the summary the device call prints


@pytest.mark.server
def test_variants_run_the_open_loop_at_fixed_rates_with_its_traces(tiny_checkpoint, tmp_path):
    """RATES: each variant's served part runs the open loop at those rates (a goodput A/B in one device call), traced
    as the closed loop's levels, its breakdown per rate in the results and its traces in the pack."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = variants_environment(tiny_checkpoint, tmp_path, RATES="1", RATE_DURATION="2",
                               BENCH_ARGS="--warmup 0 --drain-timeout 60 " + SHORT_WORKLOAD)
    try:
        done = subprocess.run(["bash", "benchmarks/served_variants.sh", str(out), "open||"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=260)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the variant did not end; left running: {processes_naming(str(work))}")
    finally:
        left = stop_what_is_left(str(work))
    assert done.returncode == 0 and left == [], done.stdout + done.stderr
    with tarfile.open(out / "open.tgz") as packed:
        names = set(packed.getnames())
        results = json.loads(packed.extractfile("open/served/results.json").read())
    assert [(rate["rate"], rate["failed_by_code"], rate["not_started"]) for rate in results["rates"]] == [
        (1.0, {}, 0)], results["rates"]
    assert results["rates"][0]["completed"] == results["rates"][0]["sent"] >= 1
    assert [row["rate"] for row in results["ttfa_breakdown"]] == [1.0]  # where its first audio went, per rate
    assert any(name.startswith("open/served/trace/server-r1") for name in names), sorted(names)[:20]


def stop_what_is_left(text: str) -> list[str]:
    """Never leave a server of a test behind, whatever failed: SIGINT to the launcher (it stops tritonserver and
    removes the stubs' shared memory), then SIGKILL to what is still there. Returns what was running."""
    left = processes_naming(text)
    if left:
        serve = [line.split(":")[0] for line in left if "omni_triton.cli serve" in line]
        subprocess.run(["kill", "-INT", *serve], check=False)
        for _ in range(60):
            if not any("tritonserver" in line for line in processes_naming(text)):
                break
            time.sleep(0.5)
        for line in processes_naming(text):
            subprocess.run(["kill", "-KILL", line.split(":")[0]], check=False)
    return left
