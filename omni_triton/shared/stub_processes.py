"""The Python-backend stub processes of a running tritonserver, found through /proc: which model instance each
one runs, whether it is still alive. The launcher watches them to restart the server, the orchestrator's stage
supervisor to reload a stage, the bench to read their CPU time."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

from omni_triton.shared.procfs import FLAGS, PARENT, PF_EXITING, START_TICKS, STATE, parse_stat, stat_fields


# A stage's stub asked with this signal writes every thread's Python stack to the server's log and goes on
# (stages.model_args.report_native_crashes registers it): a stop or a request that hangs says where.
STACK_DUMP_SIGNAL = signal.SIGUSR1


def ask_for_stacks(pids: list[int], parent: int) -> list[int]:
    """Send ``STACK_DUMP_SIGNAL`` to the stubs of ``pids`` still alive under ``parent``; the pids asked."""
    asked = []
    for pid in pids:
        if stub_alive(pid, parent):
            try:
                os.kill(pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                continue
            asked.append(pid)
    return asked


def stub_alive(pid: int, parent: int) -> bool:
    return _alive(stat_fields(pid), parent)


def _alive(fields: list[str] | None, parent: int) -> bool:
    """Whether a process's ``stat_fields`` say it runs as a child of ``parent``: a killed stub stays a zombie, and
    before that it is exiting (and answers no IPC any more)."""
    return (fields is not None and fields[STATE] not in "ZX" and int(fields[PARENT]) == parent
            and not int(fields[FLAGS]) & PF_EXITING)


class StubWatch:
    """``stub_alive`` of one process, asked often (every response a stage sends to it): its /proc stat file is kept
    open and read again each time, some 5 us where opening it by path costs 25-35 us. The open file stays that
    process's: once it is gone a read fails, whatever process takes its pid later."""

    def __init__(self, pid: int, parent: int):
        """Raises OSError when there is no process ``pid``."""
        self._fd, self._parent = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC), parent

    def alive(self) -> bool:
        try:
            return _alive(parse_stat(os.pread(self._fd, 4096, 0), upto=FLAGS + 1), self._parent)
        except OSError:  # gone (ESRCH)
            return False

    def close(self) -> None:
        os.close(self._fd)


class StubLiveness:
    """Whether stub processes (children of one tritonserver) live, asked afresh each time: through a ``StubWatch``
    per pid, so an answer costs a read of an open file, not a lookup of /proc by path. Asked at every response a
    stage sends to its caller (``callers``) and before every call the orchestrator sends to a stage
    (``stage_supervisor``). Not through a cache of recent answers: a send that starts after its caller died is stuck
    for good (the stage then exits, ``callers.STUCK_SEND_S``, and is reloaded), and a request sent to a dead stage
    can abort the whole server, so under load a cache's window after a kill, even of a few ms, would let some
    through. A pid seen dead is forgotten (its file closed): it may come back as a fresh stub's."""

    def __init__(self, server_pid: int, watch: Callable[[int, int], StubWatch] = StubWatch):
        self._server_pid, self._watch = server_pid, watch
        self._watches: dict[int, StubWatch] = {}
        self._lock = threading.Lock()  # no file is closed while another thread reads it

    def alive(self, pid: int) -> bool:
        with self._lock:
            watch = self._watches.get(pid)
            if watch is None:
                try:
                    watch = self._watch(pid, self._server_pid)
                except OSError:  # no such process
                    return False
                self._watches[pid] = watch
            if watch.alive():
                return True
            watch.close()
            del self._watches[pid]
            return False


def find_stubs(parent: int, stages: list[str]) -> dict[str, int]:
    """stage -> the pid of its first live instance stub (for stages of one instance)."""
    return {stage: stubs[min(stubs)] for stage, stubs in find_stub_instances(parent, stages).items()}


def stub_instance(argv: list[str]) -> tuple[str, str] | None:
    """(model, instance name) of a model-instance stub's command line, or None for any other process. A stub's
    argv is [stub, <repository>/<model>/<version>/model.py, shm region, 2 sizes, parent pid, backend dir, ipc
    handle, name, ...]; the name is the instance's (talker_0_0, talker_0_1) except in the short-lived stub that
    auto-completes the model's config while it loads, where it is the model's own: that one is no instance."""
    parts = Path(argv[1]).parts if len(argv) > 8 else ()
    if len(parts) >= 3 and parts[-1] == "model.py" and argv[8] != parts[-3]:
        return parts[-3], argv[8]
    return None


def find_stub_instances(parent: int, stages: list[str]) -> dict[str, dict[str, int]]:
    """stage -> {instance name: pid} of the live model-instance stubs (``stub_instance``) of ``stages`` among
    ``parent``'s children (the config stub exiting is no death). Of two live stubs of one instance name the one
    started last: a model reloaded while one of its instances still runs requests (its old model is unloaded only
    once they end, never if a dead stub held some) has an old and a new stub of that name, and the new one serves."""
    found: dict[str, dict[str, tuple[int, int]]] = {}  # stage -> instance -> (start ticks, pid)
    for entry in Path("/proc").iterdir():
        fields = stat_fields(int(entry.name)) if entry.name.isdigit() else None
        if not _alive(fields, parent):
            continue
        try:
            argv = [os.fsdecode(arg) for arg in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        instance = stub_instance(argv)
        if instance is not None and instance[0] in stages:
            started = (int(fields[START_TICKS]), int(entry.name))
            instances = found.setdefault(instance[0], {})
            instances[instance[1]] = max(instances.get(instance[1], started), started)
    return {stage: {name: pid for name, (_, pid) in instances.items()} for stage, instances in found.items()}


def superseded(pid: int, parent: int) -> bool:
    """Whether the stub ``pid`` (of ``parent``) no longer is its model instance's: a stub of the same instance name
    started after it (its model was reloaded while it still ran requests, ``find_stub_instances``). False for a
    process that is no stub."""
    try:
        argv = [os.fsdecode(arg) for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return False
    instance = stub_instance(argv)
    if instance is None:
        return False
    newest = find_stub_instances(parent, [instance[0]]).get(instance[0], {}).get(instance[1])
    return newest is not None and newest != pid
