"""Windows of torch.profiler in every stage process: the GPU kernels and host threads of a second of serving.

Off unless ``OMNI_TRITON_PROFILE_DIR`` names a directory. Each stage process that calls ``start_watching`` (every
model_repository/*/1/model.py does, in ``initialize``) then watches that directory for trigger files: a file
``<dir>/<label>.trigger`` holding a duration in seconds starts a window in every stage at once, and each writes
``<dir>/<label>/<stage>-<pid>.json``, a Chrome trace (open it in Perfetto or chrome://tracing).
``request_window`` writes a trigger (the bench calls it in the middle of a load level); ``bench/stage_profiles``
summarises the traces. CPU operator events come from every thread where this torch can record them
(``profile_all_threads``), else from the watching thread only; CUDA kernels and runtime calls come from the
whole process either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

PROFILE_DIR_ENV = "OMNI_TRITON_PROFILE_DIR"
POLL_S = 0.1

logger = logging.getLogger(__name__)


def request_window(directory: str | Path, label: str, duration_s: float) -> Path:
    """Ask every stage watching ``directory`` to profile ``duration_s`` seconds from now into ``directory/label``."""
    if not label or not all(c.isalnum() or c in "-_" for c in label):
        raise ValueError(f"a profile label is letters, digits, '-' and '_', got {label!r}")
    if duration_s <= 0:
        raise ValueError(f"a profile window needs a positive duration, got {duration_s!r}")
    trigger = Path(directory) / f"{label}.trigger"
    trigger.parent.mkdir(parents=True, exist_ok=True)
    temporary = trigger.with_suffix(".tmp")
    temporary.write_text(str(duration_s))
    temporary.rename(trigger)  # whole when a watcher sees it
    return trigger


def start_watching(stage: str) -> threading.Thread | None:
    """Watch for profile windows on a thread of this process's own (None when profiling is off)."""
    directory = os.environ.get(PROFILE_DIR_ENV)
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=_watch, args=(Path(directory), stage), name="stage-profile", daemon=True)
    thread.start()
    return thread


def pending_windows(directory: Path, done: set[str]) -> list[tuple[str, float]]:
    """Triggers in ``directory`` not handled yet: (label, duration), oldest label first."""
    windows = []
    for trigger in sorted(directory.glob("*.trigger")):
        label = trigger.stem
        if label in done:
            continue
        done.add(label)
        try:
            windows.append((label, float(trigger.read_text())))
        except (OSError, ValueError):
            logger.warning("stage profile: unreadable trigger %s", trigger)
    return windows


def _watch(directory: Path, stage: str) -> None:
    done = {trigger.stem for trigger in directory.glob("*.trigger")}  # windows from before this process
    while True:
        time.sleep(POLL_S)
        for label, duration in pending_windows(directory, done):
            _profile(directory / label / f"{stage}-{os.getpid()}.json", duration)


def _profile(path: Path, duration: float) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # older torch: operators of this thread only
        config = None
    try:
        with profile(activities=activities, experimental_config=config) as profiler:
            time.sleep(duration)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        print(f"stage profile written to {path}", flush=True)
    except Exception:  # a profile is a diagnostic: it must never take the stage down
        logger.exception("stage profile %s failed", path)
