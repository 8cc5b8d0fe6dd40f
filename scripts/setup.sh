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

# perf_analyzer (from tritonclient[all]) links libb64; Debian/Ubuntu ship it as libb64-0d.
if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d) >/dev/null \
      || echo "setup: could not install libb64-0d: perf_analyzer tests will be skipped" >&2
  else
    echo "setup: libb64-0d missing (sudo apt-get install libb64-0d): perf_analyzer tests will be skipped" >&2
  fi
fi

stamp="$VENV/.omni-triton-installed"
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  # The CPU build first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[embedded,test]"
  echo "$wanted" > "$stamp"
fi
echo "setup: $("$VENV/bin/python" -c 'import sys, torch, tritonclient; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")') in $VENV"
