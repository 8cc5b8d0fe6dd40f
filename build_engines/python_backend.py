"""Build Triton's Python backend from pinned sources for the running interpreter.

    omni-triton build python-backend [--source DIR] [--gpu/--no-gpu] [--out DIR] [--force]

Sources: python_backend r26.07 (it carries upstream's fixes #398, #423, #433, #439 for the defects of the
Triton 2.51 backend bundled with nvidia-pytriton) and the core/common/backend/pybind11/dlpack commits it
builds against, fetched by commit from GitHub (a shallow fetch each), or unpacked from ``--source DIR``
holding their ``git archive`` tarballs (``<name>-<ref>-<short commit>.tar.gz``). Our patches
(``python_backend_patches/``, each saying why) are applied on top: an offline build, and a lock-order fix
for decoupled BLS that upstream main still lacks.

Needs: a C++ compiler, cmake >= 3.31.8 (``pip install cmake``), ninja (``pip install ninja``) or make,
the headers of boost, RapidJSON, libarchive and zlib (Debian/Ubuntu: ``apt-get install libboost-dev
rapidjson-dev libarchive-dev zlib1g-dev``), this Python's headers, and nvcc for ``--gpu``. Each is checked
first, and a missing one is named with where it comes from.

The result is a backend directory (default: inside this interpreter's environment, see
``omni_triton.launch.python_backend``) that ``omni-triton serve`` picks up by itself. A build that matches
the wanted sources, patches, interpreter and GPU flag is not repeated.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omni_triton.launch.python_backend import BACKEND_FILES, BUILD_INFO, default_built_dir, interpreter_key

PATCH_DIR = Path(__file__).with_name("python_backend_patches")
MIN_CMAKE = (3, 31, 8)


@dataclass(frozen=True)
class PinnedSource:
    name: str  # the folder it unpacks to, and the FetchContent name python_backend gives it
    url: str
    ref: str  # the tag or branch the commit was taken from (the tarball names it)
    commit: str

    @property
    def tarball(self) -> str:
        return f"{self.name}-{self.ref}-{self.commit[:7]}.tar.gz"


SOURCES = (
    PinnedSource("python_backend", "https://github.com/triton-inference-server/python_backend", "r26.07",
                 "4b3337cd60cca29a7ea2820898eb41eeee7c95f4"),
    PinnedSource("core", "https://github.com/triton-inference-server/core", "r26.06",
                 "eaff04d5d77eb1c32e98c573c90fb78b363c88c0"),
    PinnedSource("common", "https://github.com/triton-inference-server/common", "r26.07",
                 "ecb874c3126f9f07810f4900d4e7b088fee5eb8c"),
    PinnedSource("backend", "https://github.com/triton-inference-server/backend", "main",
                 "3f57fb90bee16b86232ee79c45eb4ce69c9ad489"),
    PinnedSource("pybind11", "https://github.com/pybind/pybind11", "v2.12.0",
                 "3e9dfa2866941655c56877882565e7577de6fc7b"),
    PinnedSource("dlpack", "https://github.com/dmlc/dlpack", "v0.8", "365b823cedb281cd0240ca601aba9b78771f91a3"),
)
# FetchContent names python_backend declares, per source folder.
FETCHCONTENT_NAMES = {"core": "REPO-CORE", "common": "REPO-COMMON", "backend": "REPO-BACKEND",
                      "pybind11": "PYBIND11", "dlpack": "DLPACK"}
# header -> where it comes from, checked before configuring (a missing one otherwise fails deep in the build)
HEADERS = {
    "boost/interprocess/managed_external_buffer.hpp": "apt-get install libboost-dev",
    "rapidjson/document.h": "apt-get install rapidjson-dev",
    "archive.h": "apt-get install libarchive-dev",
    "zlib.h": "apt-get install zlib1g-dev",
}


class BuildError(RuntimeError):
    """A missing tool or header, or a failed step; the message says which and what to do."""


def log(message: str) -> None:
    print(f"[python-backend] {message}", flush=True)


# -- checks ----------------------------------------------------------------------------------------------
def find_cmake() -> str:
    candidates = [str(Path(sys.executable).parent / "cmake"), shutil.which("cmake")]
    found = []
    for cmake in filter(None, candidates):
        if not os.access(cmake, os.X_OK):
            continue
        output = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        match = re.search(r"version (\d+)\.(\d+)\.(\d+)", output)
        version = tuple(int(v) for v in match.groups()) if match else (0, 0, 0)
        if version >= MIN_CMAKE:
            return cmake
        found.append(f"{'.'.join(map(str, version))} at {cmake}")
    raise BuildError(f"cmake >= {'.'.join(map(str, MIN_CMAKE))} is needed (found: {', '.join(found) or 'none'}); "
                     f"it comes from pip: {sys.executable} -m pip install 'cmake>=3.31.8'")


def find_generator() -> tuple[str, list[str]]:
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    if os.access(ninja, os.X_OK):
        return "Ninja", [f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    if shutil.which("make"):
        return "Unix Makefiles", []
    raise BuildError(f"neither ninja nor make found: {sys.executable} -m pip install ninja")


def find_compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found (apt-get install g++, or set CXX)")


def check_headers(compiler: str) -> Path:
    """Every header the build includes from the system; returns the include dir that holds boost/."""
    python_include = sysconfig.get_paths()["include"]
    checks = dict(HEADERS, **{"Python.h": f"this Python's headers (python{sys.version_info.major}."
                                          f"{sys.version_info.minor}-dev), expected in {python_include}"})
    missing = []
    for header, source in checks.items():
        probe = subprocess.run([compiler, "-E", "-x", "c++", "-", f"-I{python_include}", "-o", os.devnull],
                               input=f"#include <{header}>\n", capture_output=True, text=True)
        if probe.returncode != 0:
            missing.append(f"{header} ({source})")
    if missing:
        raise BuildError("missing headers: " + "; ".join(missing))
    listing = subprocess.run([compiler, "-E", "-x", "c++", "-", "-H", "-o", os.devnull],
                             input="#include <boost/version.hpp>\n", capture_output=True, text=True).stderr
    header = next(line.split()[-1] for line in listing.splitlines() if line.endswith("boost/version.hpp"))
    return Path(header).resolve().parent.parent


def default_gpu() -> bool:
    """GPU support when CUDA can be compiled for and a driver is present (the machine will run it)."""
    return bool(shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()) and \
        Path("/proc/driver/nvidia").exists()


# -- sources ----------------------------------------------------------------------------------------------
def patches_for(source: PinnedSource) -> list[Path]:
    return sorted(PATCH_DIR.glob(f"{source.name}-*.patch"))


def fetch_sources(source_dir: Path | None, work: Path) -> Path:
    """Unpack (``source_dir``) or shallow-fetch every pinned source into ``work/src``, patched."""
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for source in SOURCES:
        target = src / source.name
        if source_dir is not None:
            tarball = Path(source_dir) / source.tarball
            if not tarball.is_file():
                raise BuildError(f"--source {source_dir}: no {source.tarball} ({source.url} at {source.commit})")
            log(f"unpacking {tarball.name}")
            run(["tar", "xzf", str(tarball), "-C", str(src)])
            if not target.is_dir():
                raise BuildError(f"{tarball} did not unpack into a folder named {source.name}/")
        else:
            if not shutil.which("git"):
                raise BuildError("git is needed to fetch the sources (or pass --source DIR with the tarballs)")
            log(f"fetching {source.url} at {source.commit[:7]} ({source.ref})")
            target.mkdir()
            run(["git", "init", "-q"], cwd=target)
            run(["git", "fetch", "-q", "--depth", "1", source.url, source.commit], cwd=target)
            run(["git", "checkout", "-q", "FETCH_HEAD"], cwd=target)
        for patch in patches_for(source):
            log(f"applying {patch.name}")
            # The ceiling keeps git from taking an enclosing repository for this tree's.
            run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=target,
                env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(src)))
    return src


# -- build ----------------------------------------------------------------------------------------------
def wanted_info(gpu: bool, build_type: str) -> dict:
    patches = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for s in SOURCES for p in patches_for(s)}
    return dict(interpreter_key(), gpu=gpu, build_type=build_type,
                sources={s.name: f"{s.ref}@{s.commit[:7]}" for s in SOURCES}, patches=patches)


def up_to_date(out: Path, wanted: dict) -> bool:
    try:
        built = json.loads((out / "python" / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    same = {k: built.get(k) for k in wanted} == wanted
    return same and all((out / "python" / name).is_file() for name in BACKEND_FILES)


def configure_args(src: Path, build: Path, gpu: bool, build_type: str, boost_include: Path) -> list[str]:
    generator, generator_args = find_generator()
    python = sys.executable
    args = [
        "-S", str(src / "python_backend"), "-B", str(build), "-G", generator, *generator_args,
        f"-DCMAKE_BUILD_TYPE={build_type}",
        f"-DTRITON_ENABLE_GPU={'ON' if gpu else 'OFF'}",
        f"-DCMAKE_INSTALL_PREFIX={build / 'install'}",
        "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
        *(f"-DFETCHCONTENT_SOURCE_DIR_{name}={src / folder}" for folder, name in FETCHCONTENT_NAMES.items()),
        f"-DTRITON_BOOST_INCLUDE_DIR={boost_include}",  # python_backend-system-boost.patch
        "-DTRITON_COMMON_ENABLE_TESTS=OFF",  # common-skip-tests.patch
        "-DCMAKE_POLICY_VERSION_MINIMUM=3.5",  # dlpack v0.8's CMakeLists predates CMake 3.5
        # a pyenv shim or another python first on PATH would otherwise be embedded
        f"-DPython3_EXECUTABLE={python}", f"-DPython_EXECUTABLE={python}", f"-DPYTHON_EXECUTABLE={python}",
        # RapidJSON 1.1 (Debian/Ubuntu) uses std::iterator, deprecated in C++17: gcc 13 + -Werror stops on it
        "-DCMAKE_CXX_FLAGS=-Wno-deprecated-declarations",
    ]
    if gpu:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    return args


def run(command: list[str], cwd: Path | None = None, env: dict | None = None, log_file: Path | None = None,
        progress: bool = False) -> None:
    """Run a step; output goes to ``log_file`` (ninja's [n/total] counter echoed every 10%) or is captured,
    and a failure raises with the last lines of it."""
    with tempfile.TemporaryFile("w+") if log_file is None else open(log_file, "a") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        tail: list[str] = []
        shown = -10
        for line in process.stdout:
            sink.write(line)
            tail = (tail + [line.rstrip()])[-25:]
            match = re.match(r"\[(\d+)/(\d+)\]", line) if progress else None
            if match:
                percent = 100 * int(match.group(1)) // int(match.group(2))
                if percent >= shown + 10:
                    shown = percent
                    log(f"  {percent:3d}% ({match.group(1)}/{match.group(2)} steps)")
        if process.wait() != 0:
            where = f" (full log: {log_file})" if log_file else ""
            raise BuildError(f"{' '.join(command[:3])} ... failed with code {process.returncode}{where}:\n"
                             + "\n".join(tail))


def build(source_dir: Path | None, out: Path, gpu: bool, work: Path, build_type: str, jobs: int,
          force: bool) -> Path:
    wanted = wanted_info(gpu, build_type)
    if not force and up_to_date(out, wanted):
        log(f"up to date: {out / 'python'} (--force rebuilds)")
        return out
    started = time.monotonic()
    log(f"building for Python {wanted['python']} ({sys.executable}), {'GPU' if gpu else 'CPU-only'}, "
        f"into {out}")
    log("checking tools and headers")
    cmake = find_cmake()
    compiler = find_compiler()
    boost_include = check_headers(compiler)
    if gpu and not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()):
        raise BuildError("--gpu needs the CUDA toolkit's nvcc on PATH (or build --no-gpu)")
    work.mkdir(parents=True, exist_ok=True)
    src = fetch_sources(source_dir, work)
    build_dir = work / "build"
    shutil.rmtree(build_dir, ignore_errors=True)
    log_file = work / "build.log"
    log_file.write_text("")
    log(f"configuring with {cmake} (log: {log_file})")
    run([cmake, *configure_args(src, build_dir, gpu, build_type, boost_include)],
        env=dict(os.environ, CXX=compiler), log_file=log_file)
    log(f"compiling with {jobs} jobs")
    run([cmake, "--build", str(build_dir), "--parallel", str(jobs)], log_file=log_file, progress=True)
    run([cmake, "--install", str(build_dir)], log_file=log_file)
    install(build_dir / "install" / "backends" / "python", out / "python", wanted)
    log(f"done in {time.monotonic() - started:.0f} s: {out / 'python'}")
    return out


def install(built: Path, target: Path, info: dict) -> None:
    """Replace ``target`` with the built files (through a sibling folder, so a server never sees half)."""
    staging = target.with_name(target.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in BACKEND_FILES:
        shutil.copy2(built / name, staging / name)
    (staging / BUILD_INFO).write_text(json.dumps(dict(info, built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
                                                 indent=1))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-triton build python-backend",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path,
                        help="folder with the pinned source tarballs (default: fetch each commit from GitHub)")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="build with CUDA tensor support (default: when nvcc and an NVIDIA driver are present)")
    parser.add_argument("--out", type=Path, default=default_built_dir(),
                        help="backend directory to install into; serve looks here (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path,
                        help="sources and build tree (default: a temporary folder, removed after a good build)")
    parser.add_argument("--debug", action="store_true", help="RelWithDebInfo: symbols for gdb (default: Release)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs "
                                                                                "(default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the installed build matches")
    args = parser.parse_args(argv)
    gpu = default_gpu() if args.gpu is None else args.gpu
    build_type = "RelWithDebInfo" if args.debug else "Release"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omni-triton-python-backend-"))
    try:
        build(args.source, args.out.resolve(), gpu, work.resolve(), build_type, args.jobs, args.force)
    except BuildError as error:
        print(f"omni-triton build python-backend: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
