"""CPU time of a local server's processes while a benchmark level runs, as % of one core and in ms per completed
request: tritonserver itself and each stage instance's Python-backend stub (``orchestrator_0_0``, ``talker_0_1``, ...).

A stub runs its Python one thread at a time (the GIL), so one near 100% is a stage bound by its host work however
idle its GPU is: what the TTFA breakdown's delivery segments ("first frame to the orchestrator") cannot tell
apart from GPU queueing. Its CPU per request says how many requests/s that one core allows (1000 / ms). Read from
/proc, so only for a server on this machine (the bench's own or one started beside it); None otherwise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from omni_triton.shared.procfs import PARENT, SYSTEM_TICKS, USER_TICKS, stat_fields
from omni_triton.shared.stub_processes import stub_instance

SERVER_BINARY = "tritonserver"
STUB_BINARY = "triton_python_backend_stub"
DEFAULT_GRPC_PORT = 8001


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _cpu_ticks(pid: int) -> int | None:
    """User + system clock ticks from /proc/<pid>/stat; None when the process is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[USER_TICKS]) + int(fields[SYSTEM_TICKS])


def serves_port(argv: list[str], grpc_port: int) -> bool:
    """Whether a tritonserver command line listens for gRPC on ``grpc_port`` (8001 when it names none)."""
    named = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--grpc-port=")]
    return named == [str(grpc_port)] if named else grpc_port == DEFAULT_GRPC_PORT


def process_name(argv: list[str]) -> str | None:
    """"tritonserver", a model-instance stub's instance name (e.g. ``talker_0_1``), or None."""
    if not argv:
        return None
    binary = os.path.basename(argv[0])
    if binary == SERVER_BINARY:
        return SERVER_BINARY
    instance = stub_instance(argv) if binary == STUB_BINARY else None
    return None if instance is None else instance[1]


def server_processes(grpc_port: int) -> dict[str, int] | None:
    """name (``process_name``) -> pid of the tritonserver serving ``grpc_port`` and of each of its stub processes;
    None when no single tritonserver on this machine serves that port."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[PARENT])
    servers = [pid for pid in parents if (argv := _cmdline(pid)) and process_name(argv) == SERVER_BINARY
               and serves_port(argv, grpc_port)]
    if len(servers) != 1:
        return None
    found = {SERVER_BINARY: servers[0]}
    for pid, parent in parents.items():
        name = process_name(_cmdline(pid)) if parent == servers[0] else None
        if name is not None and name != SERVER_BINARY:
            found[name] = pid
    return found


def server_cpu_ticks(grpc_port: int) -> dict[str, int] | None:
    """Clock ticks used so far by the tritonserver serving ``grpc_port`` and by each of its stub processes."""
    processes = server_processes(grpc_port)
    if processes is None:
        return None
    return {name: ticks for name, pid in processes.items() if (ticks := _cpu_ticks(pid)) is not None}


def local_grpc_port(url: str | None) -> int | None:
    """The port of a gRPC address on this machine (host:port), else None: /proc only sees local servers."""
    host, _, port = (url or "").rpartition(":")
    return int(port) if port.isdigit() and host in ("127.0.0.1", "localhost", "0.0.0.0", "[::1]") else None


def ms_per_request(seconds: dict[str, float] | None, completed: int) -> dict[str, float] | None:
    """CPU seconds by process over a level -> ms per completed request; None without a reading or a completion."""
    if not seconds or completed <= 0:
        return None
    return {name: round(1000.0 * used / completed, 2) for name, used in seconds.items()}


class ServerCpu:
    """``with ServerCpu(url) as cpu: ...`` then ``cpu.percent`` and ``cpu.seconds``: per process of the server at
    ``url`` (gRPC host:port, on this machine; None: no server), its CPU time during the block as % of one core and
    in seconds; None if not measurable."""

    def __init__(self, url: str | None):
        self._port = local_grpc_port(url)
        self.percent: dict[str, float] | None = None
        self.seconds: dict[str, float] | None = None

    def __enter__(self) -> "ServerCpu":
        self._start = (time.monotonic(), server_cpu_ticks(self._port) if self._port else None)
        return self

    def __exit__(self, *exc) -> None:
        started, before = self._start
        after = server_cpu_ticks(self._port) if before else None
        if not after:
            return
        elapsed_s = max(time.monotonic() - started, 1e-9)
        # a process only in one snapshot (a stage restarted in between) has no interval to report
        self.seconds = {name: (after[name] - before[name]) / os.sysconf("SC_CLK_TCK")
                        for name in sorted(after) if name in before}
        self.percent = {name: round(100.0 * used / elapsed_s, 1) for name, used in self.seconds.items()}
