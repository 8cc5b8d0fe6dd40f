"""A stage stub asked with ``STACK_DUMP_SIGNAL`` writes every thread's Python stack and goes on; a stop whose
unload outlives its wait asks the stubs still alive before it escalates (launch.tritonserver). Over a real child
process set up as a stub sets itself up (``report_native_crashes``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

from omni_triton.launch.tritonserver import TritonServer
from omni_triton.shared.stub_processes import ask_for_stacks

STUB_LIKE = textwrap.dedent("""
    import sys, threading
    from omni_triton.stages.model_args import report_native_crashes
    report_native_crashes()

    def waits_on_a_lock_forever():
        threading.Event().wait(60)

    threading.Thread(target=waits_on_a_lock_forever, name="session-worker", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()  # until the test closes its stdin
    print("still running", flush=True)
""")


def _stub_like() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", STUB_LIKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return child


def test_a_stuck_unload_has_the_stubs_still_alive_write_their_stacks_and_go_on(tmp_path, capsys):
    child = _stub_like()
    try:
        server = types.SimpleNamespace(log_path=tmp_path / "tritonserver.log")
        TritonServer._report_stuck_unload(server, os.getpid(), {"orchestrator_0_0": child.pid}, 30.0)
        assert child.poll() is None  # the dump does not end it
        out, err = child.communicate("\n", timeout=30)
    finally:
        child.kill()
    assert out.strip() == "still running"
    # every thread's stack: the main thread's read and the worker's wait, named by their functions
    assert "Current thread" in err and "waits_on_a_lock_forever" in err, err
    said = capsys.readouterr().err
    assert "models still loaded 30 s after the stop" in said and "orchestrator_0_0" in said
    assert str(tmp_path / "tritonserver.log") in said


def test_only_live_children_of_the_server_are_asked():
    child = _stub_like()
    try:
        assert ask_for_stacks([child.pid], parent=1) == []  # not a child of that process: never signalled
        child.communicate("\n", timeout=30)
        assert ask_for_stacks([child.pid], parent=os.getpid()) == []  # exited (reaped): nothing to ask
    finally:
        child.kill()


def test_an_unload_still_running_past_its_slow_mark_is_reported_once():
    server = subprocess.Popen(["sleep", "30"])  # a server whose models never unload
    reported = []
    try:
        assert not TritonServer._wait_for_unload(server, [], 1.5, slow_after_s=0.3, on_slow=reported.append)
    finally:
        server.kill()
        server.wait()
    assert reported == [0.3]
    # one that exits before the mark is not reported
    quick = subprocess.Popen(["true"])
    assert TritonServer._wait_for_unload(quick, [], 5.0, slow_after_s=4.0, on_slow=reported.append)
    assert reported == [0.3]
