"""Find a tritonserver binary, launch it on a rendered model repository, wait until it serves, stop it.

Three installs are recognised, in this order: an explicit path (``--tritonserver`` or $TRITONSERVER),
the NGC image's /opt/tritonserver, and the binary bundled in the nvidia-pytriton wheel (the embedded
default: no Docker, CPU-only machines included). The Python backend is the one built from source
(``omni-triton build python-backend``) when present, else the install's own (``python_backend.py``).

    with TritonServer(repository, find_tritonserver()) as server:
        client = server.grpc_client()
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from omni_triton.shared import bundled_backend
from omni_triton.launch.python_backend import PYTHON_BACKEND_CHOICES, load_built_backend
from omni_triton.launch.mps import MpsDaemon, start_mps
from omni_triton.launch.drain import drain_orchestrator
from omni_triton.shared.admission_board import remove_boards
from omni_triton.shared.cancel_registry import remove_registry
from omni_triton.shared.drain import DRAIN_S
from omni_triton.shared.procfs import PARENT, stat_fields
from omni_triton.shared.placement import model_stage
from omni_triton.shared.repository_api import reload_model
from omni_triton.shared.stub_processes import ask_for_stacks, find_stub_instances, stub_alive

NGC_BINARY = Path("/opt/tritonserver/bin/tritonserver")
STUB_NAME = "triton_python_backend_stub"
STACK_DUMP_WAIT_S = 1.0  # for the stacks of stubs whose unload runs long, written before the stop goes on
STACKS_BEFORE_EXIT_S = 3.0  # stacks asked for this long before tritonserver's exit timeout ends a slow unload
# The project root, so every Python-backend stub imports this checkout's omni_triton.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class TritonServerError(RuntimeError):
    """The server could not be found, started, or did not become ready."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...]
    origin: str  # "explicit", "ngc" or "pytriton": says where it came from in logs and errors
    python_backend: str = "bundled"  # "built" (from source, in backend_dir) or "bundled" (the install's own)
    python_backend_note: str = ""  # what was chosen and why, for the launch log

    @functools.cached_property
    def help_text(self) -> str:
        result = subprocess.run([str(self.binary), "--help"], capture_output=True, text=True,
                                env=self.environment(), timeout=60)
        return result.stdout + result.stderr

    def supports(self, flag: str) -> bool:
        """Whether this build knows a command-line flag (flags come and go between Triton releases). The help
        lists each as "--name <type>", or alone on its line when it takes no value."""
        return re.search(rf"(?<!\S){re.escape(flag)}(?=\s|$)", self.help_text) is not None

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: the Python-backend stubs must embed *this* interpreter.

        The stub links libpython3.X dynamically and takes its packages from the first python on PATH, so
        the running interpreter's bin dir goes first on PATH and its LIBDIR first on LD_LIBRARY_PATH;
        otherwise a system libpython is loaded under this interpreter's stdlib and `import ssl` fails.
        """
        env = dict(os.environ if base is None else base)
        interpreter_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in (interpreter_bin, env.get("PATH", "")) if p)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        ld_paths = [libdir, *map(str, self.lib_dirs), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in ld_paths if p)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(self.stub_fixes)
        return env

    @property
    def stub(self) -> Path:
        return self.backend_dir / "python" / STUB_NAME

    @functools.cached_property
    def stub_fixes(self) -> dict[str, str]:
        """Environment that works around known bugs of the bundled Triton 2.51 stub (empty for any other)."""
        return bundled_backend.server_environment(self.stub, _cache_dir())

    def interstage_memory(self, device: str) -> str:
        """Where tensors between stages can live with this install's Python backend (``device`` unless it
        cannot carry CUDA tensors through decoupled BLS)."""
        return bundled_backend.interstage_memory(self.stub, device)


def find_tritonserver(explicit: str | os.PathLike | None = None, python_backend: str | None = None,
                      device: str = "cpu") -> TritonInstall:
    """Locate a usable tritonserver: explicit path / $TRITONSERVER, then NGC, then the pytriton bundle; and
    its Python backend: ``python_backend`` (default $OMNI_TRITON_PYTHON_BACKEND, else auto) says which."""
    choice = python_backend or os.environ.get("OMNI_TRITON_PYTHON_BACKEND") or "auto"
    if choice not in PYTHON_BACKEND_CHOICES:
        raise TritonServerError(f"python backend must be one of {PYTHON_BACKEND_CHOICES}, got {choice!r}")
    install = _find_install(explicit)
    built, why_not = load_built_backend()
    if built is not None and device == "cuda" and not built.gpu:
        built, why_not = None, f"the {built.describe()} cannot carry GPU tensors (rebuild with --gpu)"
    if choice == "built" and built is None:
        raise TritonServerError(f"--python-backend built: {why_not}")
    if choice != "bundled" and built is not None:
        return dataclasses.replace(install, backend_dir=built.directory, python_backend="built",
                                   python_backend_note=built.describe())
    note = f"the {install.origin} install's own" + ("" if choice == "bundled" else f" ({why_not})")
    return dataclasses.replace(install, python_backend_note=note)


def _find_install(explicit: str | os.PathLike | None) -> TritonInstall:
    explicit = explicit or os.environ.get("TRITONSERVER")
    if explicit:
        binary = Path(explicit).expanduser().resolve()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise TritonServerError(f"--tritonserver {explicit}: not an executable file")
        return _install_from_binary(binary, "explicit")
    if NGC_BINARY.is_file():
        return _install_from_binary(NGC_BINARY, "ngc")
    try:
        import pytriton
    except ImportError:
        raise TritonServerError(
            "no tritonserver found: pass --tritonserver PATH, run inside the NGC tritonserver image, "
            "or install the embedded default (pip install 'omni-triton[embedded]')") from None
    binary = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise TritonServerError(f"nvidia-pytriton is installed but has no tritonserver at {binary}")
    return _install_from_binary(binary, "pytriton")


def _install_from_binary(binary: Path, origin: str) -> TritonInstall:
    root = binary.parent.parent  # <root>/bin/tritonserver, <root>/backends, <root>/lib
    backend_dir = Path(os.environ.get("TRITON_BACKEND_DIR", root / "backends"))
    lib_dirs = [d for d in (root / "lib", root.parent.parent / "nvidia_pytriton.libs") if d.is_dir()]
    stubs = root / "python_backend_stubs"
    if stubs.is_dir():  # the pytriton bundle ships one stub per Python version, none installed
        backend_dir = _install_python_stub(backend_dir, stubs)
    return TritonInstall(binary, backend_dir, tuple(lib_dirs + _server_library_alias(lib_dirs)), origin)


def _server_library_alias(lib_dirs: list[Path]) -> list[Path]:
    """A backend built from source links ``libtritonserver.so`` by that name, but the nvidia-pytriton wheel
    renamed its copy (``libtritonserver-<hash>.so``, auditwheel). A link by the plain name, in a folder put
    on the server's library path, points the backend at the server's own library (the same file, which the
    loader maps once)."""
    if any((d / "libtritonserver.so").exists() for d in lib_dirs):
        return []
    renamed = sorted(p for d in lib_dirs for p in d.glob("libtritonserver-*.so"))
    if not renamed:
        return []
    alias_dir = _cache_dir() / "lib"
    alias = alias_dir / "libtritonserver.so"
    if not alias.is_symlink() or alias.resolve() != renamed[0].resolve():
        alias_dir.mkdir(parents=True, exist_ok=True)
        partial = alias_dir / f".libtritonserver.so.{os.getpid()}"
        partial.unlink(missing_ok=True)
        partial.symlink_to(renamed[0].resolve())
        partial.replace(alias)  # atomic: concurrent launches never see a missing link
    return [alias_dir]


def _install_python_stub(backend_dir: Path, stubs: Path) -> Path:
    """Put the stub for the running interpreter into backends/python/ (a cache copy if read-only)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = stubs / version / STUB_NAME
    if not stub.is_file():
        available = sorted(p.name for p in stubs.iterdir())
        raise TritonServerError(f"the tritonserver bundle has no Python backend stub for Python {version} "
                                f"(has {available})")
    for candidate in (backend_dir, _cache_dir() / "backends"):
        target = candidate / "python" / STUB_NAME
        try:
            if candidate != backend_dir and not (candidate / "python").is_dir():
                shutil.copytree(backend_dir, candidate, dirs_exist_ok=True)
            if not target.is_file() or target.stat().st_size != stub.stat().st_size:
                shutil.copy2(stub, target)
            if not os.access(target, os.X_OK):
                target.chmod(0o755)
            return candidate
        except OSError:
            continue
    raise TritonServerError(f"cannot install the Python backend stub into {backend_dir} or {_cache_dir()}")


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "omni-triton" / f"tritonserver-py{sys.version_info.major}{sys.version_info.minor}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    gpu: bool = False
    gpu_ids: tuple[int, ...] = (0,)  # the GPUs the stages run on (gpu): each gets a CUDA memory pool
    # Lets the orchestrator reload a stage whose stub died (Triton 2.51 never restarts one) through the
    # repository API, which clients can then reach too: off by default, keep the server on loopback.
    stage_reload: bool = False
    cuda_memory_pool_bytes: int = 256 << 20  # GPU tensors cross stub processes through this pool
    log_verbose: int = 0
    exit_timeout_s: int = 10
    # a graceful stop first lets the streams in flight run this long (the orchestrator's drain), then ends them
    drain_s: float = DRAIN_S
    extra_args: list[str] = field(default_factory=list)
    mps: str = "off"  # CUDA MPS for the stages sharing a GPU: auto | on | off (omni_triton.launch.mps)


class TritonServer:
    """A tritonserver process serving ``repository``; a context manager that always stops it."""

    def __init__(self, repository: str | os.PathLike, install: TritonInstall | None = None,
                 options: ServerOptions | None = None, log_path: str | os.PathLike | None = None,
                 echo_log: bool = False, echo_lines_with: str | None = None):
        """``echo_log``: the whole server log to stderr; else ``echo_lines_with``: only its lines containing that
        (the stages' warm-up progress) to stdout."""
        self.repository = Path(repository).resolve()
        self.install = install or find_tritonserver()
        self.options = options or ServerOptions()
        self.log_path = Path(log_path) if log_path else self.repository.parent / "tritonserver.log"
        self.echo_log = echo_log
        self.echo_lines_with = echo_lines_with
        self.process: subprocess.Popen | None = None
        self.mps: MpsDaemon | None = None
        self.stop_outcome = ""  # how the last stop ended: "graceful", or the signal it had to escalate to
        self.drain_outcome: str | None = None  # why the last graceful stop did not drain (None: it did, or none ran)
        self._stop_echo = threading.Event()
        self._reloads = 0  # models reloaded alone (reload_alone): each reload's config names its number

    # -- addresses -------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def grpc_client(self):
        import tritonclient.grpc as grpcclient
        return grpcclient.InferenceServerClient(self.grpc_url)

    def http_client(self):
        import tritonclient.http as httpclient
        return httpclient.InferenceServerClient(self.http_url)

    @property
    def shm_prefix(self) -> str:
        return f"omni{os.getpid()}_{self.options.grpc_port}_"

    # -- lifecycle -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        o = self.options
        args = [
            str(self.install.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.install.backend_dir}",
            *(["--model-control-mode=explicit", "--load-model=*"] if o.stage_reload else ["--model-control-mode=none"]),
            f"--http-address={o.host}", f"--http-port={o.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            f"--log-verbose={o.log_verbose}",
            f"--exit-timeout-secs={o.exit_timeout_s}",
            # Python-backend shared-memory names are global: keep two servers on one host apart.
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if o.gpu:
            args += [f"--cuda-memory-pool-byte-size={gpu}:{o.cuda_memory_pool_bytes}" for gpu in o.gpu_ids]
        else:  # no CUDA driver: don't try to pin host memory
            args.append("--pinned-memory-pool-byte-size=0")
            # Triton loads 4 models at a time: the fifth stage would start its stub only once one of the first four
            # is loaded, a core idle meanwhile. On the CPU the loads share nothing to race on (on a GPU they share
            # its memory): all at once.
            args.append(f"--model-load-thread-count={max(len(self.repository_models()), 4)}")
        # Every config is rendered whole (launch/repository.py). With auto-complete on, the Python backend starts a
        # stub process per model load only to offer the model its config (its interpreter and model.py's imports,
        # seconds) before the instance's own stub starts: at the server's start, and on the request path of a
        # stage's reload after its process died (serve --allow-stage-reload).
        if self.install.supports("--disable-auto-complete-config"):
            args.append("--disable-auto-complete-config")
        if self.install.supports("--allow-client-shm"):  # Triton >= 2.69 refuses client shm otherwise
            args.append("--allow-client-shm=true")
        return args + list(o.extra_args)

    def start(self) -> "TritonServer":
        if not self.repository.is_dir():
            raise TritonServerError(f"model repository {self.repository} does not exist")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.mps is not None:
            self.mps.stop()  # a restart: its daemon goes before a new one starts (a no-op after stop())
        self.mps = start_mps(self.options.mps, self.options.gpu)
        try:
            with open(self.log_path, "wb") as log:
                # A new session makes the server and its stub processes one process group to signal.
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                env=self.mps.server_environment(self.install.environment()),
                                                start_new_session=True)
        except BaseException:
            self.mps.stop()  # no server, so nothing will stop its daemon later
            raise
        if self.echo_log or self.echo_lines_with:
            threading.Thread(target=self._echo_log, daemon=True).start()
        return self

    def wait_ready(self, models: list[str] | None = None, timeout_s: float = 120.0) -> float:
        """Block until the server and every model are ready and the metrics port answers; returns seconds waited.
        (Triton loads the models, then starts its endpoints: HTTP says ready some 40 ms before the metrics
        service listens, and a client that reads the metrics at "ready" was refused.)"""
        models = self.repository_models() if models is None else models
        start = time.monotonic()
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise TritonServerError(f"tritonserver exited with code {code} before it was ready\n"
                                        f"{self.log_tail()}")
            if (self._ready("/v2/health/ready") and all(self._ready(f"/v2/models/{m}/ready") for m in models)
                    and self._answers(self.metrics_url)):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TritonServerError(f"tritonserver not ready after {timeout_s:.0f} s "
                                        f"(models {models})\n{self.log_tail()}")
            time.sleep(0.2)

    def _ready(self, path: str) -> bool:
        """HTTP 200 from a KServe health endpoint (plain urllib: no client library needed to launch)."""
        return self._answers(f"http://{self.http_url}{path}")

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:  # refused while starting, or 400 (not ready yet)
            return False

    def repository_models(self) -> list[str]:
        return sorted(p.name for p in self.repository.iterdir() if (p / "config.pbtxt").is_file())

    def stop(self, timeout_s: float = 20.0, graceful: bool = True) -> int | None:
        """Drain the orchestrator (graceful: the streams in flight end while the server still takes their stage
        calls), then SIGINT (Triton unloads every model), then SIGTERM, then SIGKILL, to the whole group; SIGKILL
        at once when not ``graceful``."""
        self._stop_echo.set()
        self.drain_outcome = None
        if graceful and self.process is not None and self.process.poll() is None \
                and "orchestrator" in self.repository_models():
            self.drain_outcome = drain_orchestrator(self.grpc_url, self.options.drain_s)
        try:
            return self._stop_server(timeout_s, graceful)
        finally:
            if self.mps is not None:
                self.mps.stop()  # after the server: its clients must be gone first

    def _stop_server(self, timeout_s: float, graceful: bool) -> int | None:
        stub_names = self.stub_pids()
        stubs = list(stub_names.values())
        process, self.process = self.process, None
        if process is None:
            return None
        self.stop_outcome = "graceful"
        signals = ((signal.SIGINT, timeout_s), (signal.SIGTERM, 5.0)) if graceful else ()
        for sig, wait_s in (*signals, (signal.SIGKILL, 5.0)):
            if process.poll() is not None:
                break
            if sig != signal.SIGINT:
                self.stop_outcome = f"escalated to {sig.name}"
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGINT:  # its whole wait is the unload's: past it, on to SIGTERM (not a second wait)
                # stubs still alive near the server's own exit timeout write their stacks while they still can
                # (past it tritonserver exits, models loaded or not, and its stubs go with it)
                slow_after_s = max(min(wait_s, self.options.exit_timeout_s) - STACKS_BEFORE_EXIT_S, 1.0)
                if self._wait_for_unload(process, stubs, wait_s, slow_after_s,
                                         lambda waited_s: self._report_stuck_unload(process.pid, stub_names,
                                                                                    waited_s)):
                    break
                continue
            try:
                process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self._kill_leftover_group(process.pid)
        self._remove_shared_memory()
        remove_registry(process.pid)  # what the orchestrator instances' cancel registry held when it went
        remove_boards(process.pid)  # and their admission records
        return process.returncode

    def _report_stuck_unload(self, server_pid: int, stubs: dict[str, int], waited_s: float) -> None:
        """An unload still running ``waited_s`` into a stop: the stubs still alive (instance name -> pid) write
        their threads' stacks to the server's log (``ask_for_stacks``), so the log says what each waited on."""
        asked = ask_for_stacks(list(stubs.values()), server_pid)
        if asked:
            time.sleep(STACK_DUMP_WAIT_S)  # (faulthandler writes from the signal handler: at once)
            names = [name for name, pid in stubs.items() if pid in asked]
            print(f"tritonserver: models still loaded {waited_s:g} s after the stop; the stacks of "
                  f"{', '.join(names)} are in {self.log_path}", file=sys.stderr)

    @staticmethod
    def _wait_for_unload(process: subprocess.Popen, stubs: list[int], timeout_s: float,
                         slow_after_s: float | None = None, on_slow: Callable[[float], None] = lambda s: None) -> bool:
        """After SIGINT: True once the server has exited, or has unloaded every model. On shutdown Triton
        (2.51) looks for models still loaded once a second and exits at the first look that finds none, so up
        to a second passes after the last stub process exited with nothing left to do; a server whose every
        stub has exited (each after its model's finalize) is ended then instead of at that look. ``on_slow``
        is called once with ``slow_after_s`` if the unload is still running then."""
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return True
            if slow_after_s is not None and time.monotonic() - started >= slow_after_s:
                on_slow(slow_after_s)
                slow_after_s = None
            if stubs and not any(stub_alive(pid, process.pid) for pid in stubs):
                try:
                    process.wait(0.2)  # the usual case when the last model unloads just before a look
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                return True
            time.sleep(0.05)
        return False

    def _remove_shared_memory(self) -> None:
        """A server that crashed leaves its stubs' regions in /dev/shm; nothing else uses this prefix."""
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)

    @staticmethod
    def _kill_leftover_group(pgid: int) -> None:
        """Stubs outliving the server would hold shared memory and cores: kill what is left."""
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 30) -> str:
        """The log's error lines, then its last lines: what a failed start needs to be understood."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no server log at {self.log_path})"
        errors = [line for line in text if line.startswith("E") or "error" in line.lower()][-lines:]
        return (f"--- errors in {self.log_path} ---\n" + "\n".join(errors)
                + f"\n--- last {min(lines, len(text))} lines ---\n" + "\n".join(text[-lines:]))

    def _echo_log(self) -> None:
        with open(self.log_path, "r", errors="replace") as log:
            while not self._stop_echo.is_set():
                line = log.readline()
                if not line:
                    time.sleep(0.2)
                elif self.echo_log:
                    sys.stderr.write(line)
                elif self.echo_lines_with in line:
                    sys.stdout.write(line)
                    sys.stdout.flush()

    def stub_pids(self, models: list[str] | None = None) -> dict[str, int]:
        """instance name (talker_0_0, talker_0_1) -> pid of its Python-backend stub process, for ``models``
        (default: all)."""
        if self.process is None:
            return {}
        stubs = find_stub_instances(self.process.pid, self.repository_models() if models is None else models)
        return {name: pid for instances in stubs.values() for name, pid in instances.items()}

    def supervise(self, ready_timeout_s: float, max_restarts: int, log: Callable[[str], None],
                  reloaded_by_orchestrator: tuple[str, ...] = (), stopped: Callable[[], bool] = lambda: False) -> int:
        """Keep the server up until Ctrl-C. A native crash in a backend takes the whole process down; a stub
        that dies leaves its model answering nothing (Triton 2.51 never restarts stubs). Either way: stop what
        is left and start again, up to ``max_restarts`` times. Stubs of ``reloaded_by_orchestrator`` are left
        to the orchestrator (``--allow-stage-reload``), and with stage reload (``options.stage_reload``), when
        every dead stub is an orchestrator instance's, the orchestrator model is reloaded alone through the
        repository API (``reload_alone``), the server and the stages kept. Triton reloads a model whole: every
        orchestrator instance gets a fresh stub and takes the new requests; the requests in flight on the other,
        live instances run to their end on their old stubs (Triton unloads the old model only once its requests
        have ended, which the dead instance's never do: those old stubs stay, idle, until the server stops).
        Returns the exit code of the run not restarted, or 0 once ``stopped()`` (another thread stops the server:
        a bench's own server is not restarted then)."""
        def watched_stubs() -> dict[str, int]:
            # a pipeline's copy of a stage (thinker_p1) is reloaded like the stage
            return self.stub_pids([m for m in self.repository_models()
                                   if model_stage(m)[0] not in reloaded_by_orchestrator])

        restarts, watched = 0, watched_stubs()
        while True:
            while self.process is not None and self.process.poll() is None and not stopped():
                dead = [m for m, pid in watched.items() if not stub_alive(pid, self.process.pid)]
                only_orchestrators = bool(dead) and {instance_model(instance) for instance in dead} == {"orchestrator"}
                if only_orchestrators and self.options.stage_reload and self.reload_alone(
                        "orchestrator", dead, ready_timeout_s, log):
                    watched = watched_stubs()
                    continue
                if dead:
                    log(f"the stub process of {dead} died; its requests can never complete")
                    break
                time.sleep(0.1)  # until it is seen, requests fail with Triton's UNKNOWN "Stub ... is not healthy"
            else:
                dead = []
                if stopped():
                    return 0
                code = None if self.process is None else self.process.returncode
                log(f"tritonserver exited with code {code}\n{self.log_tail()}")
            if restarts >= max_restarts:
                log(f"not restarting: {max_restarts} restarts already (--max-restarts)")
                return self.process.returncode if self.process is not None and self.process.returncode else 1
            restarts += 1
            # A dead stub's requests can never complete: a graceful stop would only answer new ones with
            # "unknown model" (UNKNOWN) while the others unload, where a stopped server refuses the connection
            # (UNAVAILABLE) and restarts sooner.
            self.stop(graceful=not dead)
            log(f"restarting tritonserver ({restarts}/{max_restarts}) ...")
            self.start()
            self.wait_ready(timeout_s=ready_timeout_s)
            watched = watched_stubs()  # before saying so: what dies after "ready" must be seen
            log(f"tritonserver ready again after restart {restarts}")

    def reload_alone(self, model: str, dead: list[str], ready_timeout_s: float, log: Callable[[str], None]) -> bool:
        """Load ``model`` (whose instances ``dead`` lost their stubs) again through the repository API, the server
        and every other model's stubs kept, and wait until every model serves (Triton reloads the ensemble on top
        of it in the same call); whether that worked (if not, the caller restarts the whole server). The stages
        drop what the dead stubs' requests held in them themselves (``omni_triton.stages.callers``)."""
        self._reloads += 1
        start = time.monotonic()
        log(f"the stub process of {dead} died; reloading {model} alone (every instance of it) ...")
        try:
            steps = reload_model(f"http://{self.http_url}", model, f"launcher-{self._reloads}", ready_timeout_s)
            self.wait_ready(timeout_s=ready_timeout_s)
        except (OSError, ValueError, TritonServerError) as error:
            log(f"reloading {model} failed: {error}")
            return False
        log(f"{model} reloaded alone in {time.monotonic() - start:.1f} s (the load request sent {steps.config_s:.2f} s "
            f"in, Triton loaded it {steps.load_s:.2f} s after that; tritonserver pid {self.process.pid} kept)")
        return True

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def instance_model(instance: str) -> str:
    """The model of a model instance's name: Triton names an instance ``<group>_<index>``, and a group is either
    the default ``<model>_<index>`` or one named ``<model>_<word>`` (``placement``: ``orchestrator_p1`` per
    pipeline), so the model is what comes before the last two underscores: ``orchestrator_0_1``,
    ``orchestrator_p1_0`` -> ``orchestrator``; ``thinker_p1_0_0`` -> ``thinker_p1``."""
    return instance.rsplit("_", 2)[0]


def process_tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (tritonserver + its stub processes), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        try:
            statm = (entry / "statm").read_text().split()
        except OSError:
            continue
        if fields is None:
            continue
        children.setdefault(int(fields[PARENT]), []).append(int(entry.name))
        rss[int(entry.name)] = int(statm[1]) * page
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += rss.get(current, 0)
        todo.extend(children.get(current, []))
    return total
