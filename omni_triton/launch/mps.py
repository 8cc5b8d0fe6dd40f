"""CUDA MPS for the stages that share a GPU: ``serve --mps auto|on|off``.

Each stage is a process of its own (a Python-backend stub), and without MPS a GPU time-slices between processes:
the thinker's, talker's and vocoder's kernels never run at once, and each switch costs a context switch. Under
MPS they share one GPU context through the control daemon, so kernels of different stages overlap.

``auto`` (the default for ``--device cuda``): use the host's control daemon when one is running (its pipe
directory, ``$CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``, holds a ``control`` socket), else start one of
our own when ``nvidia-cuda-mps-control`` is installed, else go without and say so. ``on``: the same, but no MPS
is an error. Our own daemon gets private pipe and log directories (nothing else on the host talks to it), is
passed to tritonserver through the environment, and is told to quit when the server stops. MPS is a daemon,
not a GPU setting: the GPU's compute mode is left as it is.
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


class MpsError(RuntimeError):
    """--mps on, and MPS cannot be had here."""


@dataclass
class MpsDaemon:
    """What serving uses: ``environment`` for tritonserver, ``note`` for the launch log; ``stop`` quits a
    daemon of our own (never the host's)."""

    environment: dict[str, str] = field(default_factory=dict)
    note: str = "off"
    own_directory: Path | None = None
    binary: str | None = None

    def stop(self) -> None:
        if self.own_directory is None:
            return
        env = {**os.environ, **self.environment}
        try:
            subprocess.run([self.binary], input=b"quit\n", env=env, timeout=30, capture_output=True, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the daemon dies with the machine; nothing else holds on to it
        shutil.rmtree(self.own_directory, ignore_errors=True)
        self.own_directory = None


def start_mps(choice: str, gpu: bool, environ: dict[str, str] | None = None) -> MpsDaemon:
    """The MPS daemon serving uses (see the module's doc); ``environ`` defaults to this process's."""
    if choice not in MPS_CHOICES:
        raise MpsError(f"--mps must be one of {MPS_CHOICES}, got {choice!r}")
    environ = dict(os.environ if environ is None else environ)
    if choice == "off" or not gpu:
        return MpsDaemon(note="off" if choice == "off" else "off (no GPU)")
    host_pipe = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)
    if (host_pipe / "control").exists():
        return MpsDaemon(note=f"the host's control daemon ({host_pipe})")
    binary = shutil.which(CONTROL_BINARY, path=environ.get("PATH"))
    if binary is None:
        why = f"{CONTROL_BINARY} not found on PATH and no control daemon at {host_pipe}"
        if choice == "on":
            raise MpsError(f"--mps on: {why}")
        return MpsDaemon(note=f"off ({why}: the stages time-slice the GPU)")
    # A short path: the pipe directory holds unix sockets, whose paths are limited to ~107 bytes.
    own = Path(tempfile.mkdtemp(prefix="omni-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(own / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(own / "log")}
    for directory in env.values():
        Path(directory).mkdir()
    result = subprocess.run([binary, "-d"], env={**environ, **env}, capture_output=True, timeout=30, check=False)
    if result.returncode != 0:
        shutil.rmtree(own, ignore_errors=True)
        why = f"{CONTROL_BINARY} -d exited with {result.returncode}: {(result.stderr or result.stdout).decode()[-300:]}"
        if choice == "on":
            raise MpsError(f"--mps on: {why}")
        return MpsDaemon(note=f"off ({why})")
    return MpsDaemon(environment=env, note=f"own control daemon (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})",
                     own_directory=own, binary=binary)
