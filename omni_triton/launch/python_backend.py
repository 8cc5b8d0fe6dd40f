"""Which Python backend tritonserver loads: the one built from source, or the one its install ships.

``omni-triton build python-backend`` builds Triton's Python backend (python_backend r26.07 + our patches in
``build_engines/python_backend_patches/``) for the running interpreter and installs it as a backend directory
holding ``python/{libtriton_python.so, triton_python_backend_stub, triton_python_backend_utils.py}`` and a
``build.json`` that says what it was built from. ``serve`` then loads it instead of the install's own
(``--python-backend auto|built|bundled``, default auto: built when a usable build is present).

Why build one: the backend bundled with nvidia-pytriton 0.7.0 (Triton 2.51) cannot carry CUDA tensors through
decoupled BLS and crashes under concurrent streams (``omni_triton/shared/bundled_backend/``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PYTHON_BACKEND_CHOICES = ("auto", "built", "bundled")
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py")
BUILD_INFO = "build.json"
# Ends the requests of a decoupled model whose stub died, an error each, where they got no answer.
DEAD_STUB_PATCH = "python_backend-dead-stub-requests.patch"


def default_built_dir() -> Path:
    """Where ``build python-backend`` installs by default: inside the environment of this interpreter (the
    stub embeds exactly this Python), so a new venv builds its own. $OMNI_TRITON_PYTHON_BACKEND_DIR overrides."""
    explicit = os.environ.get("OMNI_TRITON_PYTHON_BACKEND_DIR")
    return Path(explicit) if explicit else Path(sys.prefix) / "lib" / "omni-triton" / "backends"


def interpreter_key() -> dict[str, str]:
    """What a built stub must match: it links this interpreter's libpython and imports its packages."""
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "executable": sys.executable}


@dataclass(frozen=True)
class BuiltBackend:
    directory: Path  # pass as --backend-directory: it holds python/
    info: dict

    @property
    def gpu(self) -> bool:
        return bool(self.info.get("gpu"))

    @property
    def ends_dead_stub_requests(self) -> bool:
        """Whether a decoupled request whose stub died ends with an UNAVAILABLE error naming the model instance
        (``DEAD_STUB_PATCH``); without it the request gets no answer (the client's own timeout ends it)."""
        return DEAD_STUB_PATCH in self.info.get("patches", {})

    def describe(self) -> str:
        sources = self.info.get("sources", {})
        gpu = "GPU" if self.gpu else "CPU-only"
        return f"built python_backend {sources.get('python_backend', '?')} ({gpu}) from {self.directory}"


def load_built_backend(directory: Path | None = None) -> tuple[BuiltBackend | None, str]:
    """The built backend in ``directory`` (default: default_built_dir()), or None and why it is unusable."""
    directory = Path(directory) if directory else default_built_dir()
    python_dir = directory / "python"
    missing = [name for name in BACKEND_FILES if not (python_dir / name).is_file()]
    if missing:
        return None, f"no built Python backend in {directory} (missing {', '.join(missing)})"
    try:
        info = json.loads((python_dir / BUILD_INFO).read_text())
    except (OSError, ValueError) as error:
        return None, f"{python_dir / BUILD_INFO} is unreadable ({error}): rebuild it"
    wanted = interpreter_key()
    if info.get("python") != wanted["python"]:
        return None, (f"the Python backend in {directory} was built for Python {info.get('python')}, "
                      f"this is {wanted['python']}: rebuild it (omni-triton build python-backend)")
    return BuiltBackend(directory, info), ""
