"""`serve --allow-stage-reload` brings a killed orchestrator back alone: the launcher's supervise loop reloads it
through the repository API (Triton reloads the ``omni`` ensemble on top of it), the tritonserver process and the
stage stubs are kept, and the stages drop what the dead orchestrator's requests held in them (``stages.callers``:
without that, the first response a stage sends to the dead stub blocks that stage for good)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reliability_helpers import raw_stream, read_gauges, seconds_until_idle
from test_reliability import FAULT_REQUEST, MAX_INFLIGHT, _until_served, _wait_for_gauges, fault_server

from omni_triton.client import build_inputs
from omni_triton.launch.serve import STAGE_RELOADED
from omni_triton.shared.settings import STAGES
from omni_triton.shared.stub_processes import find_stubs

pytestmark = pytest.mark.reliability


def test_killed_orchestrator_is_reloaded_alone_and_the_stages_drop_its_requests(tiny_checkpoint, tmp_path):
    with fault_server(tiny_checkpoint, tmp_path) as server:
        triton = server.server
        log: list[str] = []
        stopping = threading.Event()
        watcher = threading.Thread(target=triton.supervise, daemon=True, kwargs=dict(
            ready_timeout_s=120, max_restarts=0, log=log.append, reloaded_by_orchestrator=STAGE_RELOADED,
            stopped=stopping.is_set))
        watcher.start()
        server_pid = triton.process.pid
        stubs = find_stubs(server_pid, list(STAGES))

        def in_flight(index: int):
            try:
                return raw_stream(server.grpc_url, build_inputs(f"Orchestrator fault {index}: a long story.",
                                                                **FAULT_REQUEST), timeout_s=10).error
            except TimeoutError as error:  # see the assertion below on why this may happen
                return f"no response: {error}"

        with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
            futures = [pool.submit(in_flight, index) for index in range(MAX_INFLIGHT)]
            # each stage holds every stream: thinker and talker requests, code2wav stream states
            _wait_for_gauges(server, {("omni_active_requests", "thinker"): MAX_INFLIGHT,
                                      ("omni_active_requests", "talker"): MAX_INFLIGHT,
                                      ("omni_code2wav_streams", "code2wav"): MAX_INFLIGHT})
            os.kill(stubs["orchestrator"], signal.SIGKILL)
            killed_at = time.monotonic()
            refusals, served_after = _until_served(server, killed_at, timeout_s=60)
            # every stage lets go of the dead orchestrator's requests: no KV block, request or stream held
            idle_s = seconds_until_idle(server.metrics_url, timeout_s=10)
            streams = read_gauges(server.metrics_url)[("omni_code2wav_streams", "code2wav")]
            outcomes = [future.result() for future in futures]
        stopping.set()
        watcher.join(10)
        print(f"\norchestrator killed under {MAX_INFLIGHT} streams: served again {served_after:.1f} s after the kill "
              f"({len(refusals)} refused meanwhile: {refusals[:1]}), every stage idle {idle_s:.2f} s later; "
              f"in flight: {outcomes[:1]}; launcher: {log}")

        assert triton.process.pid == server_pid and triton.process.poll() is None, "the server is not restarted"
        assert any("orchestrator reloaded alone" in line for line in log), log
        assert streams == 0, "code2wav still holds the dead orchestrator's streams"
        after = find_stubs(server_pid, list(STAGES))
        assert after["orchestrator"] != stubs["orchestrator"]
        for outcome in outcomes:
            # Triton 2.51's Python backend never answers a request whose stub died (the stub held its response
            # factory): the client's own timeout ends it, not the server
            assert outcome is not None, "a request in flight at the kill cannot have completed"
