"""Callers: a stage's requests whose caller process died are never answered and are dropped once, and a send
stuck on a dead caller ends the stage's process. Against real processes (a child of this test plays the
orchestrator's stub; this process plays tritonserver); the whole path is tests/test_orchestrator_reload.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from omni_triton.stages import callers as callers_module
from omni_triton.shared.stub_processes import StubLiveness, StubWatch, stub_alive
from omni_triton.stages.callers import Callers


def _orchestrator_stub() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.fixture
def caller(monkeypatch):
    monkeypatch.setattr(callers_module.os, "getppid", os.getpid)  # the stage's parent: this process
    process = _orchestrator_stub()
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def other_caller(caller):
    """A second orchestrator stub calling the same stage (another instance of the pipeline)."""
    process = _orchestrator_stub()
    yield process
    process.kill()
    process.wait()


def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.02)


def test_a_dead_callers_requests_are_dropped_once_and_never_answered(caller, other_caller, monkeypatch):
    dropped, sent = [], []
    callers = Callers("talker", dropped.append, exit_process=lambda code: pytest.fail("no send was stuck"))
    try:
        callers.hold("waiting", caller.pid)  # holds state, sends nothing (a talker waiting for thinker chunks)
        callers.hold("sending", caller.pid)
        callers.hold("other's", other_caller.pid)  # another orchestrator instance's request: it lives on
        callers.hold("direct", None)  # a client of the stage itself: no caller to watch
        assert callers.send("sending", caller.pid, lambda: sent.append(1))
        time.sleep(3 * callers_module.SWEEP_S)
        assert dropped == [] and sent == [1]

        caller.kill()
        caller.wait()
        assert not callers.send("sending", caller.pid, lambda: sent.append(2)), "never sent to a dead caller"
        _until(lambda: sorted(dropped) == ["sending", "waiting"])
        assert not callers.send("sending", caller.pid, lambda: sent.append(3))  # its last output, after the drop
        assert callers.send("other's", other_caller.pid, lambda: sent.append(4)), "the live caller's are sent"
        assert callers.send("direct", None, lambda: sent.append(5))
        time.sleep(3 * callers_module.SWEEP_S)
        assert sorted(dropped) == ["sending", "waiting"] and sent == [1, 4, 5], \
            "the dead caller's requests dropped once and answered never, exactly those"
    finally:
        callers.stop()


def test_a_send_stuck_on_a_caller_that_died_ends_the_stage(caller, monkeypatch):
    monkeypatch.setattr(callers_module, "STUCK_SEND_S", 0.3)
    exited, release = threading.Event(), threading.Event()
    callers = Callers("thinker", lambda key: None, exit_process=lambda code: exited.set())
    try:
        # what Triton does to a response whose caller died mid-send: the send never returns
        sender = threading.Thread(target=callers.send, args=("stuck", caller.pid, release.wait), daemon=True)
        sender.start()
        time.sleep(callers_module.STUCK_SEND_S + 3 * callers_module.SWEEP_S)
        assert not exited.is_set(), "a slow send to a live caller is no reason to exit"
        caller.kill()
        caller.wait()
        assert exited.wait(5), "the stage must exit, so that it is reloaded"
    finally:
        release.set()
        callers.stop()


def test_a_caller_is_watched_through_one_open_file_and_its_death_is_seen_at_the_next_send(caller, other_caller):
    """StubLiveness against real processes: one StubWatch (an open /proc file) per live caller, asked afresh each
    time, so the first question after a kill says dead (a zombie not yet reaped too); the dead caller's file is
    closed, and a later question looks for the pid anew (it may be a fresh stub's)."""
    opened, closed = [], []

    class CountedWatch(StubWatch):
        def __init__(self, pid, parent):
            opened.append(pid)
            super().__init__(pid, parent)

        def close(self):
            closed.append(self)
            super().close()

    liveness = StubLiveness(os.getpid(), watch=CountedWatch)
    assert all(liveness.alive(caller.pid) for _ in range(5)) and liveness.alive(other_caller.pid)
    assert opened == [caller.pid, other_caller.pid], "one open file per caller"
    caller.kill()
    _until(lambda: not stub_alive(caller.pid, os.getpid()))  # SIGKILL lands at once, but not instantly
    assert not liveness.alive(caller.pid), "a killed caller (a zombie: not reaped yet) is dead at once"
    assert len(closed) == 1 and liveness.alive(other_caller.pid)
    caller.wait()
    assert not liveness.alive(caller.pid) and opened[-1] == caller.pid, "looked for anew, and gone"
    assert not liveness.alive(2 ** 22 + 1), "no such process"


def test_the_caller_is_read_from_the_request_parameters():
    """caller_of: the pid in CALLER_PARAMETER (an int, not a bool), else None; the same parameters text, parsed once,
    answers the same every time (a talker reads it from every thinker chunk's request)."""
    from omni_triton.stages.callers import CALLER_PARAMETER, caller_of

    class Request:
        def __init__(self, parameters):
            self._parameters = parameters

        def parameters(self):
            return self._parameters

    for parameters, caller in [(f'{{"{CALLER_PARAMETER}": 4242}}', 4242), (f'{{"{CALLER_PARAMETER}": true}}', None),
                               (f'{{"{CALLER_PARAMETER}": "4242"}}', None), ('{"priority": 1}', None), ("", None),
                               (None, None), ("not json", None), ("[1, 2]", None)]:
        assert [caller_of(Request(parameters)) for _ in range(3)] == [caller] * 3, parameters
    assert caller_of(object()) is None  # no parameters at all
