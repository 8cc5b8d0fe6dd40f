"""``TritonServer.stop``'s escalation: SIGINT and the given time for the models to unload, then SIGTERM, then
SIGKILL. A server that outlives its SIGINT gets SIGTERM once that time has passed, not after waiting it out twice
(it did: 40 s instead of 20 before SIGTERM). Stand-in processes; every server test stops a real tritonserver."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from omni_triton.launch.tritonserver import ServerOptions, TritonInstall, TritonServer, free_port

# each says "set" once its SIGINT handler is in place: a stop sent earlier would meet Python's default handler
IGNORES_SIGINT = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('set', flush=True); " \
                 "time.sleep(60)"
ENDS_ON_SIGINT = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *_: sys.exit(0)); " \
                 "print('set', flush=True); time.sleep(60)"


@pytest.mark.parametrize("stand_in, outcome", [(ENDS_ON_SIGINT, "graceful"),
                                               (IGNORES_SIGINT, "escalated to SIGTERM")],
                         ids=["ends-on-sigint", "ignores-sigint"])
def test_sigterm_follows_sigint_once_the_unload_time_passed(tmp_path, stand_in, outcome):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    install = TritonInstall(binary=tmp_path / "tritonserver", backend_dir=tmp_path, lib_dirs=(), origin="explicit")
    server = TritonServer(tmp_path, install, options)  # tmp_path: a repository with no orchestrator (no drain)
    # a session of its own, as start() gives tritonserver: the stop signals the group
    process = server.process = subprocess.Popen([sys.executable, "-c", stand_in], start_new_session=True,
                                                stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "set\n"  # its handler in place, however slowly it started
    unload_s = 2.0
    start = time.monotonic()
    try:
        server.stop(timeout_s=unload_s)
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
    took = time.monotonic() - start
    assert process.poll() is not None and server.stop_outcome == outcome
    # graceful: at once; escalated: the unload time, then SIGTERM ends it (two unload times before the fix)
    assert took < (1.0 if outcome == "graceful" else unload_s + 1.5), f"stop took {took:.1f} s"
