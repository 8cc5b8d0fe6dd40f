"""Every call that synchronises the device while the pipeline serves: CUDA's sync debug mode ("warn") over the
in-process pipeline (the thinker's and talker's services and engine loops, as the served stages run them) serving
concurrent requests, each warning's Python stack grouped by where it came from in omni_triton.

A synchronising call on an engine's threads waits for every step queued on the stream before it: the talker's
admission read its prefill to the host so, ~12 ms an admission at 64 streams on the H200
(benchmarks/results/h200-gil-6fd62db). The steps' own reads of their sampled ids wait on an event, which the mode
does not count. Prints a table (thread, call site, count) and writes sync_audit.json.

    python benchmarks/sync_audit.py --device cuda --requests 16 --concurrency 8 --out-dir $OUT/sync_audit

On the CPU there is no device to wait for: the audit runs and finds nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from omni_triton.engine import EngineConfig
from omni_triton.models.config import resolve_config_dir
from omni_triton.pipeline.inprocess import InProcessPipeline

PROMPT = "Tell me about the weather today, in two short sentences."
PACKAGE = "omni_triton/"  # frames of this package name the call site
SYNC_WORD = "synchroniz"  # the mode's warning: "called a synchronizing CUDA operation"


def call_site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(innermost package frame "file:line function", the package frames above it, outermost first, joined)."""
    paths = [(frame.filename.replace("\\", "/"), frame) for frame in stack]
    names = [f"{path.split(PACKAGE, 1)[1]}:{frame.lineno} {frame.name}" for path, frame in paths if PACKAGE in path]
    if not names:
        return "(outside omni_triton)", ""
    return names[-1], " < ".join(reversed(names[-4:-1]))


class SyncRecorder:
    """Collects the sync debug mode's warnings from every thread (``warnings.showwarning`` is process-wide)."""

    def __init__(self):
        self.sites: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()
        self._shown = None

    def __enter__(self):
        self._filters = warnings.filters[:]
        warnings.filterwarnings("always", message=f".*{SYNC_WORD}")
        self._shown, warnings.showwarning = warnings.showwarning, self._record
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._shown
        warnings.filters[:] = self._filters

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WORD not in str(message).lower():
            return self._shown(message, category, filename, lineno, file, line)
        site, chain = call_site(traceback.extract_stack()[:-1])
        with self._lock:
            self.sites[(threading.current_thread().name, site, chain)] += 1


def thread_kind(name: str) -> str:
    """Request threads are named by their request: grouped as one kind."""
    return "request" if name.startswith("inprocess-") else name


def request_inputs(max_tokens: int, audio_frames: int) -> dict:
    return {"TEXT": np.array([PROMPT.encode()], dtype=np.object_), "TEMPERATURE": np.array([0.0], np.float32),
            "MAX_TOKENS": np.array([max_tokens], np.int32), "MIN_TOKENS": np.array([max_tokens], np.int32),
            "MAX_AUDIO_FRAMES": np.array([audio_frames], np.int32),
            "MIN_AUDIO_FRAMES": np.array([audio_frames], np.int32)}


def audit(args) -> dict:
    checkpoint, weights = checkpoint_dir(args.config)
    on_gpu = torch.device(args.device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = EngineConfig(num_blocks=args.num_blocks, device=args.device, kv_dtype=dtype, prefix_caching=True,
                          warmup=on_gpu)  # (its graphs captured before the audit)
    pipeline = InProcessPipeline(checkpoint, device=args.device, dtype=dtype, engine_config=config, **weights)
    inputs = request_inputs(args.max_tokens, args.audio_frames)
    try:
        pipeline.generate(inputs)  # first request outside the audit: lazy allocations, caches
        with SyncRecorder() as recorder, ThreadPoolExecutor(args.concurrency) as pool:
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                results = list(pool.map(lambda _: pipeline.generate(inputs), range(args.requests)))
            finally:
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        pipeline.close()
    grouped: Counter[tuple[str, str, str]] = Counter()
    for (thread, site, chain), count in recorder.sites.items():
        grouped[(thread_kind(thread), site, chain)] += count
    return {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
            "config": args.config, "requests": args.requests, "concurrency": args.concurrency,
            "completed_with_audio": sum(1 for _, audio in results if audio.size),
            "syncs": sum(grouped.values()),
            "sites": [{"thread": thread, "site": site, "callers": chain, "count": count}
                      for (thread, site, chain), count in grouped.most_common()]}


def checkpoint_dir(config: str) -> tuple[Path, dict]:
    """The tiny preset (built in a temp dir, its own weights) or a shipped config / checkpoint dir (seeded random
    weights)."""
    if config == "tiny":
        from omni_triton.checkpoints.tiny import build

        return build(Path(tempfile.mkdtemp(prefix="sync_audit_")) / "tiny", "tiny"), {}
    return resolve_config_dir(config), {"load_format": "dummy"}


def render(result: dict) -> str:
    lines = [f"# Synchronising calls: {result['requests']} requests, {result['concurrency']} at a time, "
             f"{result['config']} on {result['device']} (torch {result['torch']})", "",
             f"{result['syncs']} synchronising calls; {result['completed_with_audio']} of {result['requests']} "
             "requests completed with audio.", "",
             "| thread | call site | callers | count |", "|---|---|---|---:|"]
    lines += [f"| {s['thread']} | `{s['site']}` | {s['callers']} | {s['count']} |" for s in result["sites"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", help="'tiny', a shipped config name or a checkpoint dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12, help="thinker tokens a request")
    parser.add_argument("--audio-frames", type=int, default=24, help="talker frames a request")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks an engine")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    print(f"[sync_audit] {args.requests} requests on {args.device} ({args.config}) ...", flush=True)
    result = audit(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_audit.json").write_text(json.dumps(result, indent=2) + "\n")
    table = render(result)
    (out / "sync_audit.md").write_text(table)
    print(table, end="")
    return result


if __name__ == "__main__":
    main()
