"""CUDA MPS for the stages that share a GPU: ``serve --mps auto|on|off``.

Each stage is a process of its own (a Python-backend stub), and without MPS a GPU time-slices between processes:
the thinker's, talker's and vocoder's kernels never run at once, and each switch costs a context switch. Under
MPS they share one GPU context through the control daemon, so kernels of different stages overlap.

An MPS control daemon serves the GPUs that were visible to it when it started (its ``CUDA_VISIBLE_DEVICES``),
renumbered from 0: a client asking for GPU 1 of a daemon started with ``CUDA_VISIBLE_DEVICES=1`` finds no GPU.
So several servers on one host, each pinned to its GPUs with ``CUDA_VISIBLE_DEVICES``, each need a daemon that
sees their GPUs, and the device numbers tritonserver is given must be the daemon's:

- ``auto`` (the default for ``--device cuda``): the host's control daemon (its pipe directory,
  ``$CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``, holds a ``control`` socket) when it is shown to see this
  server's GPUs, else one of our own when ``nvidia-cuda-mps-control`` is installed, else none (said so).
  The host's daemon is shown to cover them when its process can be read in /proc and was started with no
  ``CUDA_VISIBLE_DEVICES`` (every GPU) or with a list holding every GPU of ours (tritonserver then gets our
  GPUs' positions in that list). A daemon that cannot be read (another user's, another container's) is used
  only by a server that is not pinned (no ``CUDA_VISIBLE_DEVICES``): it was set up for the whole host.
- ``on``: the same, but no MPS is an error. ``off``: never.

Our own daemon is started with this server's environment (so its ``CUDA_VISIBLE_DEVICES``) and private pipe and
log directories (nothing else on the host talks to it); tritonserver gets those directories and the daemon's GPUs
by their positions in it (``CUDA_VISIBLE_DEVICES=0`` for a server pinned to GPU 3: a client's list is read
against the daemon's, and torch's NVML-based GPU count must see one GPU too). It is told
to quit when the server stops, and a daemon left by a ``serve`` that was killed is quit by the next one's start.
MPS is a daemon, not a GPU setting: the GPU's compute mode is left as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MPS_CHOICES = ("auto", "on", "off")
CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = Path("/tmp/nvidia-mps")
VISIBLE = "CUDA_VISIBLE_DEVICES"
PIPE, LOG = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
OWN_PREFIX = "omni-mps-"  # + the owning serve's pid: a daemon whose owner is gone is an orphan
UNREADABLE = "unreadable"  # host_daemon_gpus: the daemon runs, but which GPUs it sees is not known


class MpsError(RuntimeError):
    """--mps on, and MPS cannot be had here."""


@dataclass
class MpsDaemon:
    """What serving uses: ``server_environment`` for tritonserver, ``note`` for the launch log; ``stop`` quits
    a daemon of our own (never the host's)."""

    environment: dict[str, str | None] = field(default_factory=dict)  # for tritonserver; None: unset it
    note: str = "off"
    own_directory: Path | None = None
    binary: str | None = None

    def server_environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        for name, value in self.environment.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def stop(self) -> None:
        if self.own_directory is not None:
            _quit(self.binary, self.own_directory)
            self.own_directory = None


def start_mps(choice: str, gpu: bool, environ: dict[str, str] | None = None) -> MpsDaemon:
    """The MPS daemon serving uses (see the module's doc); ``environ`` defaults to this process's."""
    if choice not in MPS_CHOICES:
        raise MpsError(f"--mps must be one of {MPS_CHOICES}, got {choice!r}")
    environ = dict(os.environ if environ is None else environ)
    if choice == "off" or not gpu:
        return MpsDaemon(note="off" if choice == "off" else "off (no GPU)")
    host_pipe = Path(environ.get(PIPE) or DEFAULT_PIPE_DIRECTORY)
    passed_over = ""
    if (host_pipe / "control").exists():
        host, passed_over = _the_hosts_daemon(host_pipe, environ.get(VISIBLE))
        if host is not None:
            return host
    binary = shutil.which(CONTROL_BINARY, path=environ.get("PATH"))
    if binary is None:
        why = passed_over + f"{CONTROL_BINARY} not found on PATH" + (
            "" if passed_over else f" and no control daemon at {host_pipe}")
        if choice == "on":
            raise MpsError(f"--mps on: {why}")
        return MpsDaemon(note=f"off ({why}: the stages time-slice the GPU)")
    reap_orphans(binary)
    # A short path: the pipe directory holds unix sockets, whose paths are limited to ~107 bytes.
    own = Path(tempfile.mkdtemp(prefix=f"{OWN_PREFIX}{os.getpid()}-"))
    env = {PIPE: str(own / "pipe"), LOG: str(own / "log")}
    for directory in env.values():
        Path(directory).mkdir()
    result = subprocess.run([binary, "-d"], env={**environ, **env}, capture_output=True, timeout=30, check=False)
    if result.returncode != 0:
        shutil.rmtree(own, ignore_errors=True)
        why = (f"{passed_over}{CONTROL_BINARY} -d exited with {result.returncode}: "
               f"{(result.stderr or result.stdout).decode()[-300:]}")
        if choice == "on":
            raise MpsError(f"--mps on: {why}")
        return MpsDaemon(note=f"off ({why})")
    gpus = f"GPUs {environ[VISIBLE]}" if VISIBLE in environ else "every GPU"
    return MpsDaemon(environment={**env, VISIBLE: _own_daemon_positions(environ.get(VISIBLE))}, own_directory=own,
                     binary=binary, note=f"{passed_over}own control daemon on {gpus} (pipe {env[PIPE]})")


def _own_daemon_positions(our_visible: str | None) -> str | None:
    """tritonserver's CUDA_VISIBLE_DEVICES under a daemon of our own: every one of the daemon's GPUs, by its
    position (0..n-1), or unset when the daemon sees every GPU. Not unset for a pinned server: CUDA under MPS
    then shows the daemon's GPUs alone, but torch counts GPUs through NVML, which knows nothing of MPS and
    reads CUDA_VISIBLE_DEVICES: unset, it counted every GPU of the host, and torch's first CUDA call in each
    stub failed ("device=1, num_gpus=1" on GPU 0 of a four-GPU host)."""
    ours = _gpus(our_visible)
    return None if ours is None else ",".join(str(position) for position in range(len(ours)))


def _the_hosts_daemon(pipe: Path, our_visible: str | None) -> tuple[MpsDaemon | None, str]:
    """The host's daemon listening in ``pipe`` when it is shown to see our GPUs, else (None, why not)."""
    ours, seen = _gpus(our_visible), host_daemon_gpus(pipe)
    if seen is None or (seen == UNREADABLE and ours is None):
        return MpsDaemon(note=f"the host's control daemon ({pipe})"), ""
    if seen != UNREADABLE and ours is not None and set(ours) <= set(seen):
        positions = ",".join(str(seen.index(gpu_id)) for gpu_id in ours)
        return MpsDaemon(environment={VISIBLE: positions},
                         note=f"the host's control daemon ({pipe}, its GPUs {','.join(seen)}; "
                              f"ours {','.join(ours)} are its {positions})"), ""
    sees = "cannot be shown to see" if seen == UNREADABLE else f"sees GPUs {','.join(seen)}, not all of"
    return None, f"the host's daemon at {pipe} {sees} {VISIBLE}={our_visible}; "


def _gpus(visible: str | None) -> list[str] | None:
    """A CUDA_VISIBLE_DEVICES value as its entries (indices or UUIDs); None when unset (every GPU)."""
    return None if visible is None else [entry.strip() for entry in visible.split(",") if entry.strip()]


def host_daemon_gpus(pipe: Path, proc: Path = Path("/proc")) -> list[str] | None | str:
    """The GPUs the control daemon listening in ``pipe`` was started with (None: every GPU), read from its
    process's environment; UNREADABLE when no such process can be read (another user's, another container's)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            # the daemon (-d, or -f in the foreground), not a command sent to it ("echo quit | ...")
            if Path(argv[0].decode(errors="replace")).name != CONTROL_BINARY or not {b"-d", b"-f"} & set(argv[1:]):
                continue
            environ = dict(item.split("=", 1) for item in
                           (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if Path(environ.get(PIPE) or DEFAULT_PIPE_DIRECTORY).resolve() == pipe.resolve():
            return _gpus(environ.get(VISIBLE))
    return UNREADABLE


def reap_orphans(binary: str, root: Path | None = None) -> list[Path]:
    """Quit our own daemons whose ``serve`` is gone (killed before it could stop them); returns their
    directories. A daemon keeps running without clients, so nothing else would end it."""
    reaped = []
    for own in Path(root or tempfile.gettempdir()).glob(f"{OWN_PREFIX}*-*"):
        owner = own.name[len(OWN_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)) and (own / "pipe").is_dir():
            _quit(binary, own)
            reaped.append(own)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _quit(binary: str | None, own: Path) -> None:
    env = {**os.environ, PIPE: str(own / "pipe"), LOG: str(own / "log")}
    try:
        subprocess.run([binary or CONTROL_BINARY], input=b"quit\n", env=env, timeout=30, capture_output=True,
                       check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass  # the daemon dies with the machine; nothing else holds on to it
    shutil.rmtree(own, ignore_errors=True)
