"""What a soak watches on the server besides its requests: every process's resident memory, threads and GPU memory
(sampled every few seconds), the shared-memory regions it holds, and the stages' ``omni_*`` gauges; and whether
at the end the server holds what it held at the start (``leaks``).

Processes are found through /proc (bench.server_cpu), so a server on this machine only; GPU memory per process
from ``nvidia-smi --query-compute-apps`` where there is one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from omni_triton.bench.server_cpu import _cmdline, server_processes

GPU_APPS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
SHM_PREFIX_FLAG = "shm-region-prefix-name="
# Gauges that say a stage still holds a request or its state; each must be 0 on an idle server.
HELD_GAUGES = ("omni_active_requests", "omni_waiting_requests", "omni_waiting_for_input", "omni_kv_blocks_used",
               "omni_pending_audio_frames", "omni_admission_queue_length", "omni_code2wav_streams")
FREE_GAUGE = "omni_kv_blocks_free"  # must be back at its value on the idle server at the start


def read_gauges(metrics_url: str) -> dict[str, float]:
    """The server's ``omni_*`` gauges, keyed ``name{label=value,...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families  # the bench extra: only --soak reads it

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    gauges = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("omni_"):
                labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
                gauges[f"{sample.name}{{{labels}}}"] = sample.value
    return gauges


def held(gauges: dict[str, float]) -> dict[str, float]:
    """The gauges of ``HELD_GAUGES`` that are not 0."""
    return {key: value for key, value in gauges.items() if key.split("{")[0] in HELD_GAUGES and value}


def gpu_memory_by_pid() -> dict[int, int] | None:
    """MiB of GPU memory each process holds (nvidia-smi), None without nvidia-smi."""
    if shutil.which(GPU_APPS_QUERY[0]) is None:
        return None
    try:
        result = subprocess.run(GPU_APPS_QUERY, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    used: dict[int, int] = {}
    for line in result.stdout.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and mib.isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib)
    return used if result.returncode == 0 else None


def _rss_mib(pid: int) -> float | None:
    try:
        return round(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20, 1)
    except (OSError, IndexError, ValueError):
        return None


def _threads(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def shm_regions(server_pid: int) -> list[str]:
    """The /dev/shm regions named with the server's Python-backend prefix (its --backend-config)."""
    prefixes = [arg.split(SHM_PREFIX_FLAG, 1)[1] for arg in _cmdline(server_pid) if SHM_PREFIX_FLAG in arg]
    if not prefixes or not Path("/dev/shm").is_dir():
        return []
    return sorted(path.name for path in Path("/dev/shm").iterdir() if path.name.startswith(prefixes[0]))


class ServerProbe:
    """Snapshots of the server serving gRPC on ``grpc_port`` (on this machine) and its metrics at ``metrics_url``."""

    def __init__(self, grpc_port: int | None, metrics_url: str | None):
        self.grpc_port, self.metrics_url = grpc_port, metrics_url

    def snapshot(self) -> dict:
        """{"processes": {name: {pid, rss_mib, threads, gpu_mib}}, "shm_regions": [...], "gauges": {...}}; parts
        that cannot be read are empty."""
        processes = (server_processes(self.grpc_port) if self.grpc_port else None) or {}
        gpu = gpu_memory_by_pid()
        rows = {name: {"pid": pid, "rss_mib": _rss_mib(pid), "threads": _threads(pid),
                       "gpu_mib": None if gpu is None else gpu.get(pid, 0)} for name, pid in sorted(processes.items())}
        try:
            gauges = read_gauges(self.metrics_url) if self.metrics_url else {}
        except OSError:
            gauges = {}
        server_pid = processes.get("tritonserver")
        return {"processes": rows, "shm_regions": shm_regions(server_pid) if server_pid else [], "gauges": gauges}

    def wait_idle(self, timeout_s: float, poll_s: float = 0.25) -> tuple[dict, float | None]:
        """Poll until no gauge says a stage holds something: (the last snapshot, seconds it took or None)."""
        start = time.monotonic()
        while True:
            snapshot = self.snapshot()
            if snapshot["gauges"] and not held(snapshot["gauges"]):
                return snapshot, round(time.monotonic() - start, 2)
            if time.monotonic() - start > timeout_s:
                return snapshot, None
            time.sleep(poll_s)


class Sampler:
    """``with Sampler(probe, every_s, clock) as sampler: ...``: a snapshot every ``every_s`` seconds (and at both
    ends) in ``sampler.samples``, each with ``t``, seconds on ``clock`` (the run's)."""

    def __init__(self, probe: ServerProbe, every_s: float, clock):
        self.probe, self.every_s, self.clock = probe, every_s, clock
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _take(self) -> None:
        snapshot = self.probe.snapshot()
        self.samples.append({"t": round(self.clock(), 2), "processes": snapshot["processes"],
                             "shm_regions": len(snapshot["shm_regions"]), "gauges": snapshot["gauges"]})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._take()

    def __enter__(self) -> "Sampler":
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def leaks(start: dict, end: dict, thread_reference: dict[str, int] | None = None) -> list[str]:
    """What an idle server holds at ``end`` that it did not at ``start`` (two ``snapshot``s of an idle server):
    gauges of HELD_GAUGES not 0, KV blocks free below the start's, processes with more threads than
    ``thread_reference`` (name -> threads; default the start's), shared-memory regions not there at the start.
    Empty: nothing left behind. (Thread pools grow to what the load needs and stay: a reference taken once the
    load has run a while tells that growth from threads left behind by each request.)"""
    found = [f"{key} = {value:g}" for key, value in held(end["gauges"]).items()]
    for key, value in start["gauges"].items():
        if key.startswith(FREE_GAUGE) and end["gauges"].get(key, value) < value:
            found.append(f"{key} = {end['gauges'][key]:g}, {value:g} at the start")
    for name, row in end["processes"].items():
        before = start["processes"].get(name)
        if before is None or before["pid"] != row["pid"]:
            continue  # a process restarted in between (a reloaded stage) has no start to compare with
        allowed = (thread_reference or {}).get(name, before["threads"])
        if row["threads"] is not None and allowed is not None and row["threads"] > allowed:
            found.append(f"{name}: {row['threads']} threads, {allowed} " + ("earlier in the run" if thread_reference
                                                                              else "at the start"))
    extra = sorted(set(end["shm_regions"]) - set(start["shm_regions"]))
    if extra:
        found.append(f"shared-memory regions left: {', '.join(extra)}")
    return found
