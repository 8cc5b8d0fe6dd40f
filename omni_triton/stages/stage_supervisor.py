"""Notices a stage whose Python-backend stub process died, fails what was waiting on it, and reloads it.

What Triton 2.51 (the nvidia-pytriton bundle) does when a stage's stub dies (SIGKILL, native crash): nothing.
Its Python backend has no restart path: the model still reports ready, every later request to it fails after
1-3 s with "Stub process 'talker_0_0' is not healthy.", and a request in flight on it never gets another
response, so a BLS stream from it blocks forever. Hence this watcher in the orchestrator, which calls the
stages: their stubs are its sibling processes (children of tritonserver), found through /proc. When one is
gone, the stage's generation goes up (sessions waiting on it fail at once, see ``failure``), new requests are
refused while it is down (``unavailable``), and the stage is reloaded: a fresh stub, with an empty engine.

The reload goes through the server's own HTTP repository API, not ``pb_utils.load_model``: that call holds
every other IPC of this stub (BLS calls, response sends) for the whole load, so the failed requests would
only end after it, and in model-control mode ``none`` it aborted the whole Triton 2.51 server. Reloading
needs ``--model-control-mode=explicit``; without it the stage stays down, and the refusals say why.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping

from omni_triton.load_timeline import reload_line
from omni_triton.shared.repository_api import ReloadSteps, reload_model, restart_mark
from omni_triton.shared.stub_processes import StubLiveness, find_stub_instances, superseded

logger = logging.getLogger(__name__)

UNSEEN_DEAD_STUB = -1  # no process has this pid: StubLiveness.alive() is False for it
RELOAD_HINT = " (reloading a stage needs tritonserver --model-control-mode=explicit: serve --allow-stage-reload)"


class StageSupervisor:
    def __init__(self, stages: Mapping[str, int], interval_s: float = 0.1, scan_every_s: float = 0.5,
                 reload_timeout_s: float = 600.0, reloads: bool = True,
                 on_death: Callable[[], None] | None = None):
        """``stages``: stage -> its instances (stub processes) to watch. ``reloads``: this watcher reloads a stage
        that died (False: another orchestrator instance of the pipeline does; this one waits for the new stubs).
        ``on_death``: called (from the watcher's thread) once a death is recorded: sessions sleeping in their
        waits look then (``failure``) instead of polling for it."""
        self._reloads = reloads
        self._on_death = on_death
        # stage -> its config's restart mark when this watcher saw it die (reloads False): it is back once the
        # served config carries another (its new stubs start long before the reloaded model serves)
        self._awaited_marks: dict[str, str | None] = {}
        self._server_pid = os.getppid()  # tritonserver: every stub is its child
        # asked before every call to a stage (``is_down``): an open /proc file per stub, not a lookup by path
        self._liveness = StubLiveness(self._server_pid)
        flags = _server_flags(self._server_pid)
        self._http_url = _http_url(flags)
        self._explicit = flags.get("--model-control-mode") == "explicit"
        self._reload_timeout_s = reload_timeout_s
        self._interval_s, self._scan_every_s = interval_s, scan_every_s
        self._instances = dict(stages)
        self._stubs: dict[str, dict[str, int]] = {stage: {} for stage in stages}  # stage -> {instance: pid} found
        self._scanned_at = float("-inf")
        self._seen_alive_at: dict[str, float] = {}  # stage -> when all its stubs were last seen alive
        self._watched_alive_at: dict[str, float] = {}  # the same, by this watcher's own looks (for its reload log)
        self._lock = threading.Lock()
        self._generation = dict.fromkeys(stages, 0)  # stub deaths seen, per stage
        self._down: dict[str, str] = {}  # stage -> why it serves nothing now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-supervisor", daemon=True)
        self._thread.start()

    def generations(self) -> dict[str, int]:
        """Taken when a request starts: ``failure`` compares against it."""
        with self._lock:
            return dict(self._generation)

    def failure(self, since: dict[str, int], *stages: str, max_age_s: float = 0.0) -> str | None:
        """Why a request that started at ``since`` lost one of ``stages`` (default: any), or None. With
        ``max_age_s``, a stage whose stubs were all seen alive that recently is taken as still alive: a session
        asks at every response it reads, and reading /proc each time was a fifth of the orchestrator's CPU.
        A stage down since before ``since`` is a failure too: a request admitted before the death was seen and
        started after it (it waited for admission, or for a thread) finds it down at its first call."""
        with self._lock:
            names = stages or tuple(self._generation)
            died = [stage for stage in names
                    if self._generation[stage] != since[stage] or self._dead(stage, max_age_s)]
            down = [stage for stage in names if stage in self._down]
            if not died and down:
                return f"{down[0]} stage {self._down[down[0]]}"
        return f"{died[0]} stage failed: its process exited while serving this request; retry it" if died else None

    def is_down(self, stage: str) -> bool:
        """Asked before every call to a stage. A dead stub is looked up here, not only by the watcher: a request
        sent to it can abort the whole server (Triton 2.51 throws boost::interprocess::lock_exception when the
        stub died holding its message queue's lock), so the window in which one is sent must stay tiny."""
        with self._lock:
            if stage not in self._down and len(self._stubs.get(stage, {})) < self._instances.get(stage, 0):
                self._locate(stage)
            return stage in self._down or self._dead(stage)

    def _locate(self, stage: str) -> None:
        """Find the stubs of a stage the watcher has not seen all of yet (its scans are 0.5 s apart). Requests
        come only once every stage is loaded, so an instance with no live stub then lost it before the watcher
        saw it: record it as a dead pid, and the watcher handles it like any other death."""
        found = find_stub_instances(self._server_pid, [stage]).get(stage, {})
        unseen = {f"unseen-{index}": UNSEEN_DEAD_STUB for index in range(self._instances[stage] - len(found))}
        self._stubs[stage] = {**found, **unseen}

    def _dead(self, stage: str, max_age_s: float = 0.0) -> bool:
        now = time.monotonic()
        if max_age_s > 0 and now - self._seen_alive_at.get(stage, float("-inf")) < max_age_s:
            return False
        dead = any(not self._liveness.alive(pid) for pid in self._stubs.get(stage, {}).values())
        if dead:  # only life is remembered: a death, and stubs found anew after it, are looked up every time
            self._seen_alive_at.pop(stage, None)
        else:
            self._seen_alive_at[stage] = now
        return dead

    def unavailable(self) -> str | None:
        """Why new requests must be refused now (a stage is down), or None."""
        with self._lock:
            return "; ".join(f"{stage} stage {why}" for stage, why in self._down.items()) or None

    def stop(self) -> None:
        self._stop.set()  # not joined: it may be inside a reload call for minutes

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._check()
            except Exception:  # never let the watcher die
                logger.exception("stage supervisor check failed")

    def _check(self) -> None:
        for stage in list(self._stubs):
            if not self._dead(stage):
                if self._stubs[stage]:
                    self._watched_alive_at[stage] = time.monotonic()
                continue
            seen_dead = (time.time(), time.monotonic())
            alive_at = self._watched_alive_at.pop(stage, None)
            alive_before_s = None if alive_at is None else seen_dead[1] - alive_at
            if self._server_exiting():
                logger.info("%s stage: its stub process exited: tritonserver is shutting down", stage)
                self._stop.set()  # every stub goes now: nothing to reload, nothing to report
                return
            # One step under the lock: a request that saw the dead pid (``is_down``) must also see the new
            # generation (``failure``), or it fails as INTERNAL "stage is down" instead of UNAVAILABLE.
            # One instance gone reloads the stage (all its instances: Triton reloads a model as a whole).
            # Without explicit model control no reload can succeed, so the stage is "down" from the first
            # moment: saying "restarting" while a reload that must fail is tried would be untrue.
            with self._lock:
                self._generation[stage] += 1
                self._down[stage] = ("is restarting (its process exited); retry shortly" if self._explicit
                                     else f"is down: its process exited{RELOAD_HINT}")
                self._stubs[stage] = {}
            if self._on_death is not None:
                self._on_death()
            # An orchestrator left running its requests after its own model was reloaded (serve reloads a dead
            # orchestrator's model whole) leaves the reload to the fresh stub of its instance
            if self._explicit and self._reloads and not superseded(os.getpid(), self._server_pid):
                self._restart(stage, seen_dead, alive_before_s)
            elif self._explicit:  # back once another orchestrator instance's reload is served: see below
                self._awaited_marks[stage] = self._restart_mark(stage)
                logger.error("%s stage: its stub process exited; another orchestrator instance reloads it", stage)
            else:
                logger.error("%s stage: its stub process exited; it stays down%s", stage, RELOAD_HINT)
        missing = [stage for stage, stubs in self._stubs.items() if len(stubs) < self._instances[stage]]
        # Stages load after the orchestrator, and a reload starts new processes: look for them, not too often.
        if (missing or self._awaited_marks) and time.monotonic() - self._scanned_at >= self._scan_every_s:
            self._scanned_at = time.monotonic()
            for stage in list(self._awaited_marks):
                if self._restart_mark(stage) != self._awaited_marks[stage]:
                    del self._awaited_marks[stage]  # the reloaded model serves now
            found = find_stub_instances(self._server_pid, missing) if missing else {}
            with self._lock:
                for stage, stubs in found.items():
                    self._stubs[stage].update(stubs)
                for stage, stubs in self._stubs.items():
                    if len(stubs) >= self._instances[stage] and stage not in self._awaited_marks:
                        self._down.pop(stage, None)  # reloaded by another instance, or a Triton that does itself
            # A stage Triton serves with a stub missing lost it before this watcher saw it: an orchestrator whose
            # own model was reloaded alone starts after the stages, and a stage whose send to the dead orchestrator
            # was stuck exits meanwhile (callers). Recorded as a death now, not at the first request it would fail.
            for stage in missing:
                if stage not in self._down and len(self._stubs[stage]) < self._instances[stage] and self._served(stage):
                    with self._lock:
                        self._locate(stage)

    def _served(self, stage: str) -> bool:
        """Whether Triton has ``stage`` loaded (ready: it says so after a stub died too; not while it first
        loads). Unknown (no HTTP endpoint) is taken as no."""
        if self._http_url is None:
            return False
        try:
            urllib.request.urlopen(f"{self._http_url}/v2/models/{stage}/ready", timeout=2).close()
        except OSError:  # not ready (HTTP 400), or no answer
            return False
        return True

    def _server_exiting(self) -> bool:
        """Whether tritonserver is shutting down (its liveness says so while it unloads the models). Unknown
        (no HTTP endpoint) is taken as no."""
        if self._http_url is None:
            return False
        try:
            urllib.request.urlopen(f"{self._http_url}/v2/health/live", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # answered, and not live: exiting
        except TimeoutError:  # slow under load is not exiting: a stage that died must not go unreported
            return False
        except OSError:  # refused: its endpoints are already closed
            return True
        return False

    def _restart(self, stage: str, seen_dead: tuple[float, float], alive_before_s: float | None) -> None:
        """``seen_dead``: when this watcher saw the death (unix time, monotonic); ``alive_before_s``: how long before
        that it saw the stage alive. Its log line says when each step of the reload came (load_timeline)."""
        logger.error("%s stage: its stub process exited; reloading it", stage)
        started = time.monotonic()
        try:
            steps = self._reload(stage)
        except (OSError, ValueError) as error:  # it stays down, and says why
            logger.error("%s stage: reload failed: %s", stage, error)
            with self._lock:
                self._down[stage] = f"is down: its process exited and reloading it failed ({error})"
            return
        with self._lock:
            del self._down[stage]
        self._scanned_at = float("-inf")  # watch the new stub at once
        sent_after_s = started - seen_dead[1] + steps.config_s
        logger.warning("%s", reload_line(stage, seen_dead[0], alive_before_s, sent_after_s, steps.load_s))

    def _reload(self, stage: str) -> ReloadSteps:
        if self._http_url is None:
            raise ValueError("tritonserver serves no HTTP endpoint to reload it through")
        with self._lock:
            generation = self._generation[stage]
        # this process's pid in the mark too: a reloaded orchestrator counts from 0 again, and a mark the served
        # config already carries would make the load a no-op (repository_api)
        return reload_model(self._http_url, stage, f"{os.getpid()}.{generation}", self._reload_timeout_s)

    def _restart_mark(self, stage: str) -> str | None:
        """The restart the config ``stage`` is served with names (None: never reloaded, or unknown)."""
        return None if self._http_url is None else restart_mark(self._http_url, stage)


def _server_flags(server_pid: int) -> dict[str, str]:
    """tritonserver's --name=value / --name value flags (the last of a name wins), from its command line."""
    try:
        args = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return {}
    flags = {}
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name.startswith("--"):
            flags[name] = value if equals else (args[index + 1] if index + 1 < len(args) else "")
    return flags


def _http_url(flags: dict[str, str]) -> str | None:
    """Where tritonserver serves HTTP (None if it does not)."""
    if flags.get("--allow-http", "true").lower() in ("false", "0"):
        return None
    host = flags.get("--http-address", "0.0.0.0")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{flags.get('--http-port', '8000')}"
