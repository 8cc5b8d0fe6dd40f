#!/usr/bin/env bash
# Create ./.venv (Python 3.11) with the project, the embedded tritonserver (nvidia-pytriton) and the test
# tools. Both README commands start here. Re-running is quick: pip runs again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
# Python 3.11: the torch 2.13 CPU wheel on this machine is built for it. $PYTHON overrides the search.
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PYTHON=$candidate
      break
    fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "setup: no Python 3.11 found (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi

# System packages: each is announced with the reason, installed with apt-get where we may, else named.
apt_updated=
apt_install() {  # apt_install "why" package...
  local why=$1 missing=() package
  shift
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup: missing system packages ${missing[*]} ($why); install them (Debian/Ubuntu:" \
         "sudo apt-get install ${missing[*]}) and run setup again" >&2
    exit 1
  fi
  echo "setup: apt-get install ${missing[*]} ($why)"
  if [ -z "$apt_updated" ]; then apt-get update -qq >/dev/null; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

apt_install "perf_analyzer from tritonclient[all] links libb64" libb64-0d
apt_install "the realtime tests: speech for the VAD (espeak-ng), the voice demo page in a browser (chromium)" \
  espeak-ng chromium

stamp="$VENV/.omni-triton-installed"
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  # The CPU build first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[embedded,test,backend-build]"
  echo "$wanted" > "$stamp"
fi
# Triton's Python backend built from source (python_backend r26.07 + build_engines/python_backend_patches):
# the one bundled in nvidia-pytriton (Triton 2.51) hangs or crashes with concurrent decoupled BLS streams and
# GPU tensors. Built once (about 4 minutes on 2 cores), then reused while sources, patches and Python match.
if [ "${OMNI_TRITON_SKIP_BACKEND_BUILD:-0}" = 1 ]; then
  echo "setup: OMNI_TRITON_SKIP_BACKEND_BUILD=1: serving with the Python backend bundled in nvidia-pytriton"
elif command -v c++ >/dev/null || command -v g++ >/dev/null; then
  apt_install "headers to build Triton's Python backend" libboost-dev rapidjson-dev libarchive-dev zlib1g-dev
  # The pinned source tarballs, where this checkout has them beside it; else each commit is fetched from GitHub.
  sources=${OMNI_TRITON_BACKEND_SOURCES:-../shared/third_party}
  source_args=()
  if [ -f "$sources/python_backend-r26.07-4b3337c.tar.gz" ]; then source_args=(--source "$sources"); fi
  "$VENV/bin/omni-triton" build python-backend "${source_args[@]}"
else
  echo "setup: no C++ compiler: serving with the Python backend bundled in nvidia-pytriton (see docs/python_backend.md)"
fi

echo "setup: $("$VENV/bin/python" -c 'import sys, torch, tritonclient; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")') in $VENV"
