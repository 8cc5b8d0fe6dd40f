"""StageSupervisor's look at a stage's stub processes, against real processes shaped like Python-backend stubs
(the whole path, a stub killed under a served request, is tests/test_reliability.py's killed-stage tests)."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from omni_triton.shared.stub_processes import find_stub_instances, superseded
from omni_triton.stages import stage_supervisor
from omni_triton.stages.stage_supervisor import StageSupervisor


@pytest.fixture
def fake_talker_stub(tmp_path, monkeypatch):
    """A child of this process whose argv reads as the talker_0_0 stub's; this process plays tritonserver."""
    script = tmp_path / "repository" / "talker" / "1" / "model.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\ntime.sleep(120)\n")
    stub = subprocess.Popen([sys.executable, str(script), "shm-region", "1048576", "1048576", str(os.getpid()),
                             str(tmp_path), "336", "talker_0_0", "DEFAULT"])
    monkeypatch.setattr(stage_supervisor.os, "getppid", os.getpid)
    yield stub
    stub.kill()
    stub.wait()


def test_a_stage_seen_alive_recently_is_not_looked_up_again_and_a_death_is_never_remembered(fake_talker_stub):
    supervisor = StageSupervisor({"talker": 1}, interval_s=3600)  # the watcher thread stays out of the way
    try:
        assert not supervisor.is_down("talker")  # finds the stub
        since = supervisor.generations()
        assert supervisor.failure(since, "talker", max_age_s=60) is None  # alive: remembered
        os.kill(fake_talker_stub.pid, signal.SIGKILL)
        fake_talker_stub.wait()
        assert supervisor.failure(since, "talker", max_age_s=60) is None  # within max_age_s: not looked up
        assert "talker stage failed" in supervisor.failure(since, "talker")  # a fresh look sees the death
        assert "talker stage failed" in supervisor.failure(since, "talker", max_age_s=60)  # and forgets the life
        assert supervisor.is_down("talker")
    finally:
        supervisor.stop()


def test_of_two_live_stubs_of_one_instance_the_one_started_last_is_found(fake_talker_stub, tmp_path):
    """A model reloaded while an instance of its old model still runs requests has an old and a new stub of one
    instance name (tests/test_orchestrator_reload.py): the new one is the instance now."""
    time.sleep(0.05)  # a later start in /proc's clock ticks (10 ms), whatever the pids
    assert not superseded(fake_talker_stub.pid, os.getpid())
    newer = subprocess.Popen(fake_talker_stub.args)
    try:
        assert find_stub_instances(os.getpid(), ["talker"]) == {"talker": {"talker_0_0": newer.pid}}
        # the old one leaves the stages' reloads to the new one (StageSupervisor)
        assert superseded(fake_talker_stub.pid, os.getpid()) and not superseded(newer.pid, os.getpid())
    finally:
        newer.kill()
        newer.wait()
    assert find_stub_instances(os.getpid(), ["talker"]) == {"talker": {"talker_0_0": fake_talker_stub.pid}}
    assert not superseded(fake_talker_stub.pid, os.getpid()) and not superseded(os.getpid(), os.getppid())


@pytest.fixture
def model_ready(monkeypatch):
    """An HTTP endpoint in place of tritonserver's: live, and the talker ready while ``ready["talker"]``."""
    ready = {"talker": False}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            served = self.path == "/v2/health/live" or self.path == "/v2/models/talker/ready" and ready["talker"]
            self.send_response(200 if served else 400)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(stage_supervisor, "_http_url", lambda flags: f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(stage_supervisor.os, "getppid", os.getpid)
    yield ready
    server.shutdown()


def test_a_served_stage_with_no_stub_is_a_death_a_loading_one_is_not(model_ready):
    """The watcher of an orchestrator that starts after the stages (its model reloaded alone) may never see a stage's
    stub: one that died meanwhile. Triton serving the stage with no live stub of it is that death; a stage not
    served yet is still loading."""
    supervisor = StageSupervisor({"talker": 1}, interval_s=0.02, scan_every_s=0.05)
    try:
        time.sleep(0.5)  # some ten scans
        assert supervisor.unavailable() is None and supervisor.generations() == {"talker": 0}, "still loading"
        model_ready["talker"] = True
        deadline = time.monotonic() + 5
        while supervisor.generations() == {"talker": 0}:
            assert time.monotonic() < deadline, "the death was never recorded"
            time.sleep(0.02)
        assert "talker stage is down: its process exited" in supervisor.unavailable()
    finally:
        supervisor.stop()


def test_a_request_started_after_the_death_was_seen_fails_naming_the_stage(fake_talker_stub, monkeypatch):
    """A request admitted before the watcher saw a death and started after it (it waited for admission or for a
    thread) takes its generations after the bump: its call finds the stage down ("talker stage is down", a
    StageError), and ``failure`` must still name the stage, or the orchestrator answers INTERNAL
    (tests/test_admission_server.py has the whole path)."""
    monkeypatch.setattr(stage_supervisor, "_http_url", lambda flags: None)  # no server: no reload, not exiting
    supervisor = StageSupervisor({"talker": 1}, interval_s=3600)  # the watcher's checks run here, by hand
    try:
        assert not supervisor.is_down("talker")
        os.kill(fake_talker_stub.pid, signal.SIGKILL)
        fake_talker_stub.wait()
        before = supervisor.generations()
        supervisor._check()  # the watcher sees the death: a new generation, the stage down
        after = supervisor.generations()
        assert after != before and supervisor.is_down("talker")
        assert "talker stage failed" in supervisor.failure(before, "talker")  # in flight at the death
        for stages in (("talker",), ()):  # one stage asked for, or any
            assert supervisor.failure(after, *stages).startswith("talker stage is down: its process exited")
            assert supervisor.failure(after, *stages, max_age_s=60).startswith("talker stage is down")
    finally:
        supervisor.stop()
