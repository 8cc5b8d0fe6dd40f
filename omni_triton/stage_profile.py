"""A window of torch.profiler in every stage process: the GPU kernels and host threads of one second of serving.

Off unless ``OMNI_TRITON_PROFILE_DIR`` names a directory. Each stage process that calls ``start_window`` (every
model_repository/*/1/model.py does, in ``initialize``) then waits ``OMNI_TRITON_PROFILE_WINDOW``'s delay
("DELAY_S,DURATION_S", default 60,1: after the server's start and a bench's warm-up), profiles for the duration
and writes ``<dir>/<stage>-<pid>.json``: a Chrome trace (open it in Perfetto or chrome://tracing; the files of
one run share CLOCK_MONOTONIC-based timestamps only within a process). ``omni-triton bench --profile-stages``
summarises the files (``bench/stage_profile_summary.py``). CPU operator events come from every thread where
this torch can record them (``profile_all_threads``), else from the thread that runs the window only; CUDA
kernels come from the whole process either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

PROFILE_DIR_ENV = "OMNI_TRITON_PROFILE_DIR"
PROFILE_WINDOW_ENV = "OMNI_TRITON_PROFILE_WINDOW"
DEFAULT_WINDOW = (60.0, 1.0)

logger = logging.getLogger(__name__)


def window_setting(value: str | None) -> tuple[float, float]:
    """``"DELAY_S,DURATION_S"`` -> (delay, duration); the default for an empty value."""
    if not value:
        return DEFAULT_WINDOW
    try:
        delay, duration = (float(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{PROFILE_WINDOW_ENV} must be DELAY_S,DURATION_S (e.g. 60,1), got {value!r}") from None
    if delay < 0 or duration <= 0:
        raise ValueError(f"{PROFILE_WINDOW_ENV} needs DELAY_S >= 0 and DURATION_S > 0, got {value!r}")
    return delay, duration


def start_window(stage: str) -> threading.Thread | None:
    """Profile this process for the configured window on a thread of its own (None when profiling is off)."""
    directory = os.environ.get(PROFILE_DIR_ENV)
    if not directory:
        return None
    delay, duration = window_setting(os.environ.get(PROFILE_WINDOW_ENV))
    path = Path(directory) / f"{stage}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=_profile, args=(path, delay, duration), name="stage-profile", daemon=True)
    thread.start()
    return thread


def _profile(path: Path, delay: float, duration: float) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    time.sleep(delay)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # older torch: operators of this thread only
        config = None
    try:
        with profile(activities=activities, experimental_config=config) as profiler:
            time.sleep(duration)
        profiler.export_chrome_trace(str(path))
        print(f"stage profile written to {path}", flush=True)
    except Exception:  # a profile is a diagnostic: it must never take the stage down
        logger.exception("stage profile for %s failed", path)
