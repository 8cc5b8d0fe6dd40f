"""At unload the orchestrator says where the sessions it still waits for are (stages/running_threads.py): a thread
still running past the grace is logged with its stack; threads that end within it are not."""

from __future__ import annotations

import threading

from omni_triton.stages.running_threads import RunningThreads, report_still_running, stacks_of


def _session(running: RunningThreads, name: str, release: threading.Event, entered: threading.Event) -> None:
    running.enter(name)
    try:
        entered.set()
        waiting_for_the_stage(release)
    finally:
        running.leave(name)


def waiting_for_the_stage(release: threading.Event) -> None:
    release.wait(30)


def test_a_thread_still_running_past_the_grace_is_logged_where_it_waits():
    running, release, entered = RunningThreads(), threading.Event(), threading.Event()
    thread = threading.Thread(target=_session, args=(running, "request r1", release, entered))
    thread.start()
    assert entered.wait(10)
    logged: list[str] = []
    try:
        stacks = report_still_running(running, 0.2, logged.append)
    finally:
        release.set()
        thread.join(10)
    assert list(stacks) == ["request r1"] and len(logged) == 1
    assert "request r1 still running 0.2 s after the stop began" in logged[0]
    assert "waiting_for_the_stage" in logged[0] and "release.wait(30)" in logged[0]
    assert running.snapshot() == {}


def test_threads_that_end_within_the_grace_are_not_logged():
    running, release, entered = RunningThreads(), threading.Event(), threading.Event()
    thread = threading.Thread(target=_session, args=(running, "request r2", release, entered))
    thread.start()
    assert entered.wait(10)
    threading.Timer(0.1, release.set).start()
    logged: list[str] = []
    assert report_still_running(running, 10.0, logged.append) == {} and logged == []
    thread.join(10)


def test_a_thread_that_ended_meanwhile_says_so():
    assert stacks_of({"gone": -1}) == {"gone": "(ended)\n"}


def test_a_process_that_outlives_its_bound_writes_every_threads_stack():
    import subprocess
    import sys

    script = ("import time\nfrom omni_triton.stages.running_threads import dump_if_still_alive\n"
              "def unloading():\n    dump_if_still_alive(0.2)\n    time.sleep(2)\nunloading()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "most recent call first" in done.stderr and "unloading" in done.stderr, done.stderr
    quick = subprocess.run([sys.executable, "-c", script.replace("time.sleep(2)", "pass")], capture_output=True,
                           text=True, timeout=60)
    assert quick.returncode == 0 and "most recent call first" not in quick.stderr, quick.stderr
