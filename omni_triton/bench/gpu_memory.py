"""GPU memory in use while a benchmark level runs: device-wide, as nvidia-smi reports it, so a served run counts
tritonserver and every stage's stub process, and an in-process run its own process. Per GPU as well as summed:
with the stages placed on several GPUs (``serve --stage-gpus``) what each GPU holds is what limits it."""

from __future__ import annotations

import shutil
import subprocess
import threading

QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def gpu_memory_used_mib() -> list[int] | None:
    """MiB in use on each visible GPU, in nvidia-smi's order; None without nvidia-smi or a GPU."""
    if shutil.which(QUERY[0]) is None:
        return None
    try:
        result = subprocess.run(QUERY, capture_output=True, text=True, timeout=10)
        values = [int(line) for line in result.stdout.split() if line.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return values if result.returncode == 0 and values else None


class GpuMemoryPeak:
    """``with GpuMemoryPeak() as peak: ...`` then ``peak.gib``: the most in use (summed over the GPUs), and
    ``peak.gib_per_gpu``: each GPU's most in use, polled every ``interval_s`` (None where nothing could be read)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.peak_mib: int | None = None
        self.peak_mib_per_gpu: list[int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory", daemon=True)

    def __enter__(self) -> "GpuMemoryPeak":
        self._sample()
        if self.peak_mib is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()

    @property
    def gib(self) -> float | None:
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)

    @property
    def gib_per_gpu(self) -> list[float] | None:
        return None if self.peak_mib_per_gpu is None else [round(mib / 1024, 2) for mib in self.peak_mib_per_gpu]

    def _sample(self) -> None:
        used = gpu_memory_used_mib()
        if used is None:
            return
        self.peak_mib = max(sum(used), self.peak_mib or 0)
        previous = self.peak_mib_per_gpu or [0] * len(used)
        self.peak_mib_per_gpu = [max(now, before) for now, before in zip(used, previous)]

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()
