"""Where the threads an unload waits for are: a stop that hangs says why.

The orchestrator's unload waits for its request threads (their pool joins them, and Triton's exit timeout runs
meanwhile). A request still running after the drain is a request whose thread waits somewhere it should not;
``report_still_running`` waits a short grace for such threads and then logs each one's stack; ``dump_if_still_alive``
has every thread's stack written out if the process outlives its unload by a bound (whatever it waits on: a hang
after the model's own code, in the interpreter's exit, shows there too).
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback
from typing import Callable


class RunningThreads:
    """Names (request ids) of work in progress -> the thread running it; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads: dict[str, int] = {}

    def enter(self, name: str) -> None:
        with self._lock:
            self._threads[name] = threading.get_ident()

    def leave(self, name: str) -> None:
        with self._lock:
            self._threads.pop(name, None)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._threads)


def stacks_of(threads: dict[str, int]) -> dict[str, str]:
    """Each named thread's current stack, formatted (innermost call last); a thread that ended meanwhile says so."""
    frames = sys._current_frames()
    return {name: "".join(traceback.format_stack(frames[ident])) if ident in frames else "(ended)\n"
            for name, ident in threads.items()}


def report_still_running(running: RunningThreads, grace_s: float, log: Callable[[str], None],
                         poll_s: float = 0.05) -> dict[str, str]:
    """Wait up to ``grace_s`` for ``running`` to empty; then ``log`` one message per thread still running, with
    its stack. Returns those stacks (empty when every thread ended in time)."""
    deadline = time.monotonic() + grace_s
    while (threads := running.snapshot()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    stacks = stacks_of(threads)
    for name, stack in stacks.items():
        log(f"unloading: {name} still running {grace_s:.1f} s after the stop began, at:\n{stack}")
    return stacks


def dump_if_still_alive(after_s: float) -> None:
    """Every thread's stack to stderr (the server log) once ``after_s`` have passed, unless the process exited
    first: faulthandler's own watchdog thread, which runs whatever the Python threads are blocked on."""
    faulthandler.dump_traceback_later(after_s, exit=False)
