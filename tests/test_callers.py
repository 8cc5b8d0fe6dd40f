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
from omni_triton.stages.callers import CallerLiveness, Callers


@pytest.fixture
def caller(monkeypatch):
    monkeypatch.setattr(callers_module.os, "getppid", os.getpid)  # the stage's parent: this process
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.02)


def test_a_dead_callers_requests_are_dropped_once_and_never_answered(caller, monkeypatch):
    monkeypatch.setattr(callers_module, "ALIVE_MAX_AGE_S", 0.0)  # the first send after the kill sees it
    dropped, sent = [], []
    callers = Callers("talker", dropped.append, exit_process=lambda code: pytest.fail("no send was stuck"))
    try:
        callers.hold("waiting", caller.pid)  # holds state, sends nothing (a talker waiting for thinker chunks)
        callers.hold("sending", caller.pid)
        callers.hold("direct", None)  # a client of the stage itself: no caller to watch
        assert callers.send("sending", caller.pid, lambda: sent.append(1))
        time.sleep(3 * callers_module.SWEEP_S)
        assert dropped == [] and sent == [1]

        caller.kill()
        caller.wait()
        assert not callers.send("sending", caller.pid, lambda: sent.append(2)), "never sent to a dead caller"
        _until(lambda: sorted(dropped) == ["sending", "waiting"])
        assert not callers.send("sending", caller.pid, lambda: sent.append(3))  # its last output, after the drop
        time.sleep(3 * callers_module.SWEEP_S)
        assert sorted(dropped) == ["sending", "waiting"] and sent == [1], "dropped once, answered never"
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


def test_a_caller_seen_alive_recently_is_not_looked_up_again_and_a_death_is_never_remembered():
    """CallerLiveness on a clock of the test's own: one /proc look per ``max_age_s`` while the caller lives, a fresh
    look for every question once it is older, and none remembered dead (its pid may be a fresh stub's later)."""
    now, looks, living = [100.0], [], {7}

    def probe(pid: int, server_pid: int) -> bool:
        looks.append((pid, server_pid))
        return pid in living

    liveness = CallerLiveness(server_pid=1, max_age_s=0.5, probe=probe, clock=lambda: now[0])
    assert liveness.alive(7) and looks == [(7, 1)]
    now[0] += 0.4
    assert liveness.alive(7) and len(looks) == 1, "seen alive 0.4 s ago: no look"
    living.clear()  # it dies: still alive to the cache until the age runs out
    assert liveness.alive(7) and len(looks) == 1
    now[0] += 0.2
    assert not liveness.alive(7) and len(looks) == 2, "0.6 s old: looked up, dead"
    assert not liveness.alive(7) and len(looks) == 3, "a dead caller is looked up every time"
    living.add(7)  # the pid is a live stub's again
    assert liveness.alive(7) and len(looks) == 4
    assert not liveness.alive(8) and len(looks) == 5, "each caller on its own"
