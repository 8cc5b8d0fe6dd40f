"""A stage's requests whose caller (the orchestrator's stub process) died: never answered, and dropped at once.

Why: Triton 2.51's Python backend hands a decoupled BLS response to the calling stub and waits until that stub
has taken it (python_backend ``SendBLSDecoupledResponse``). A caller that died never takes it, so the first
response a stage sends to a dead orchestrator blocks the stage's sending thread for good, and every later
response of that stage, any request's, queues behind it: a fresh orchestrator would get nothing from it. And
what the dead orchestrator's requests held stays held: the thinker runs them to their max tokens, the talker
keeps their KV blocks and sequence slots while it waits for thinker chunks that never come, code2wav keeps
their stream states until its idle timeout (minutes).

So the orchestrator names itself on every stage request (request parameter ``CALLER_PARAMETER``: its pid), and
each stage keeps a ``Callers``: a response is sent only while its caller lives (``StubLiveness``); a request
whose caller is gone is dropped (``drop``, on this module's thread: never the engine's or Triton's), whether it
is sending or waiting; and a send already under way when the caller died, which can never return, ends the
stage's process (``STUCK_SEND_S``), so that the fresh orchestrator's stage supervisor reloads it.

A request without the parameter (a client calling a stage directly over gRPC) has no caller to watch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable

from omni_triton.shared.stub_processes import StubLiveness

logger = logging.getLogger(__name__)

CALLER_PARAMETER = "omni_caller_pid"
SWEEP_S = 0.2  # how often held requests' callers are looked at
STUCK_SEND_S = 2.0  # a send this old whose caller is dead can never return


def caller_parameters() -> dict[str, int]:
    """The request parameters that name this process (the orchestrator's stub) as the caller."""
    return {CALLER_PARAMETER: os.getpid()}


def caller_of(request: Any) -> int | None:
    """The pid of the stub that sent ``request``, or None (sent from outside, or without the parameter)."""
    try:
        parameters = request.parameters()
    except AttributeError:
        return None
    return _caller_in(parameters or "{}")


@functools.lru_cache(maxsize=256)
def _caller_in(parameters: str) -> int | None:
    """``caller_of`` of a request's parameters (JSON), remembered by their text: a stage's requests from one
    orchestrator carry the same text (a talker gets one per thinker chunk), and parsing it was most of the cost."""
    try:
        value = json.loads(parameters).get(CALLER_PARAMETER)
    except (AttributeError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Callers:
    def __init__(self, stage: str, drop: Callable[[str], None], exit_process: Callable[[int], None] = os._exit):
        """``drop(key)``: free what the request (or stream) ``key`` holds in the stage; called on this object's
        thread, once per key whose caller died."""
        self._stage = stage
        self._drop = drop
        self._exit = exit_process
        # tritonserver: the stages and their callers are its children
        self._liveness = StubLiveness(os.getppid())
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # key -> caller pid
        self._sending: dict[int, tuple[int, float]] = {}  # thread id -> (caller pid, when its send started)
        self._orphans: set[str] = set()  # keys to drop, in the next sweep
        self._dropped: set[str] = set()  # keys dropped (a dropped request's last output still comes to ``send``)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{stage}-callers", daemon=True)
        self._thread.start()

    def hold(self, key: str, caller: int | None) -> None:
        """``key`` holds state in the stage for ``caller`` until ``release``."""
        if caller is not None:
            with self._lock:
                self._held[key] = caller

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def alive(self, caller: int | None) -> bool:
        return caller is None or self._liveness.alive(caller)

    def send(self, key: str, caller: int | None, send: Callable[[], None]) -> bool:
        """Run ``send`` (one response of ``key``) unless its caller is dead; then ``key`` is dropped instead.
        Whether it was sent."""
        if not self.alive(caller):
            self.orphaned(key)
            return False
        if caller is None:
            send()
            return True
        thread = threading.get_ident()
        with self._lock:
            self._sending[thread] = (caller, time.monotonic())
        try:
            send()
        finally:
            with self._lock:
                del self._sending[thread]
        return True

    def orphaned(self, key: str) -> None:
        """Drop ``key`` on the next sweep (its caller is gone)."""
        with self._lock:
            if key not in self._dropped:
                self._orphans.add(key)
            self._held.pop(key, None)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self._sweep()
            except Exception:  # never let the watcher die
                logger.exception("%s: looking at callers failed", self._stage)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            held, sending = dict(self._held), list(self._sending.values())
        dead = {caller for caller in {*held.values(), *(caller for caller, _ in sending)} if not self.alive(caller)}
        if any(caller in dead and now - started > STUCK_SEND_S for caller, started in sending):
            # the send never returns (see the module's doc), nor will any later one of this stage
            logger.critical("%s stage: a response to a caller that died (pid %s) is stuck in Triton; exiting, "
                            "so that the stage is reloaded", self._stage, sorted(dead))
            self._exit(1)
        with self._lock:
            orphans = self._orphans | {key for key, caller in held.items() if caller in dead}
            self._orphans = set()
            self._dropped |= orphans  # only ever the requests a dead caller had: a few per death
            for key in orphans:
                self._held.pop(key, None)
        for key in sorted(orphans):
            logger.warning("%s stage: dropping %s, its caller died", self._stage, key)
            try:
                self._drop(key)
            except Exception:
                logger.exception("%s stage: dropping %s failed", self._stage, key)


class GuardedSender:
    """A request's response sender whose sends go through ``Callers.send`` (a stage that answers from a thread
    of its own hands these out instead of Triton's senders)."""

    def __init__(self, callers: Callers, key: str, caller: int | None, sender: Any):
        self._callers, self._key, self._caller, self._sender = callers, key, caller, sender

    def send(self, *args: Any, **kwargs: Any) -> None:
        self._callers.send(self._key, self._caller, lambda: self._sender.send(*args, **kwargs))
