"""Warm start of the vocoder: its first calls of each shape, made before the code2wav stage reports ready.

Short calls replay CUDA graphs (``stage_graph_settings``): under warm start those of the decode the stage
serves are all captured at start (stream chunks with ``--left-context-frames stateful``: every frame bucket,
nothing more to warm; else the one pass: every frame count up to the bound). Longer calls run eagerly, and the
first call of each shape is slower (cuDNN and cuBLAS choose and build their kernels for it; ONNX Runtime and
TensorRT size their buffers). Every shape cannot be warmed with a long left context, so: every call length up
to the steady state's (left context + full chunk) when that is at most ``EVERY_LENGTH_UP_TO`` frames (a short
left context, e.g. 25: adaptive chunk pacing cuts chunks of any size), else the lengths one stream's calls have
from its first chunk into the steady state (with the exact left context, a few dozen up to ~600 frames at full
size); each at every batch size up to the stage's max batch (a batch is as long as its longest chunk).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from omni_triton.models.code2wav.graphs import GraphSettings
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.warmup_progress import PROGRESS_MARK

EVERY_LENGTH_UP_TO = 64  # frames: warm every call length up to here (see above); past it, one stream's ramp


def stage_graph_settings(policy: ChunkPolicy, max_batch: int, warm_start: bool) -> dict[str, GraphSettings]:
    """``Code2WavRuntime.create``'s ``graph_settings`` and ``stream_graph_settings`` for a stage serving
    ``policy``: only the decode its chunks take is captured at start (stateful: stream chunks, in frame buckets
    with the ramp's sizes exact; else the one pass); the other one's short calls (a direct caller's) on first
    use."""
    return dict(graph_settings=GraphSettings.for_stage(max_batch, policy.first_chunk_frames, warm_start,
                                                       served=not policy.stateful),
                stream_graph_settings=GraphSettings.for_stream(max_batch, policy.ramp_sizes(), warm_start,
                                                               served=policy.stateful))


def capture_count(graph_settings: dict[str, GraphSettings]) -> int:
    """CUDA graphs captured when the runtime is built (``stage_graph_settings``): the stage's start log."""
    return sum(settings.captures_at_start for settings in graph_settings.values())


def stream_call_frames(policy: ChunkPolicy) -> list[int]:
    """Frames per vocoder call (left context + new) along one stream, up to its first steady-state call, in
    order. ``policy`` resolved (its left context known)."""
    if policy.left_context_frames is None:
        raise ValueError("resolve the policy's left_context_frames first (ChunkPolicy.resolved)")
    calls, decoded = [], 0
    while True:
        new = policy.chunk_size(decoded)
        context = min(policy.left_context_frames, decoded)
        calls.append(context + new)
        decoded += new
        if context == policy.left_context_frames and new == policy.chunk_frames:
            return calls


def warmup_calls(policy: ChunkPolicy, max_batch: int, replayed: Callable[[tuple[int, int, int]], bool],
                 num_quantizers: int) -> list[tuple[int, int, int]]:
    """The [batch, G, frames] shapes to call once (see the module doc), leaving out those ``replayed`` by a
    graph."""
    calls = stream_call_frames(policy)
    lengths = range(1, calls[-1] + 1) if calls[-1] <= EVERY_LENGTH_UP_TO else dict.fromkeys(calls)
    shapes = [(batch, num_quantizers, frames) for frames in lengths for batch in range(1, max_batch + 1)]
    return [shape for shape in shapes if not replayed(shape)]


def warm_up_vocoder(vocoder, policy: ChunkPolicy, max_batch: int,
                    log: Callable[[str], None] = lambda line: print(line, flush=True)) -> float:
    """Calls ``vocoder.decode`` (a ``Code2WavRuntime``) once per shape of ``warmup_calls``; returns the seconds."""
    graphs = getattr(vocoder, "graphs", None)
    shapes = warmup_calls(policy, max_batch, graphs.serves if graphs is not None else lambda shape: False,
                          vocoder.num_quantizers)
    captured = len(graphs.captured_shapes) if graphs is not None else 0
    log(f"code2wav: {PROGRESS_MARK}: {captured} CUDA graphs captured at start, {len(shapes)} calls of longer "
        "or unreplayed shapes to run")
    start = time.monotonic()
    for i, shape in enumerate(shapes, 1):
        vocoder.decode(torch.zeros(shape, dtype=torch.long, device=vocoder.device))
        log(f"code2wav: {PROGRESS_MARK} {i}/{len(shapes)}: batch {shape[0]} x {shape[2]} frames "
            f"({time.monotonic() - start:.1f} s)")
    if vocoder.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    log(f"code2wav: {PROGRESS_MARK} done in {elapsed:.1f} s")
    return elapsed
