"""Batch buckets of CUDA graphs (the engines' decode, completion and prefill graphs, the vocoder's): a call of
``rows`` rows replays the graph of the smallest bucket that holds it, its rows copied into the graph's static
input and the padding rows zeroed; and the one way every graph here is captured. Shared by ``engine.runner``,
``engine.prefill_graphs`` and ``models.code2wav.graphs``."""

from __future__ import annotations

import contextlib
import gc

import torch


def bucket_for(buckets, rows: int) -> int | None:
    """The smallest of the (ascending) ``buckets`` that holds ``rows``; None for no rows or too many."""
    if rows < 1:
        return None
    return next((b for b in buckets if b >= rows), None)


def fill_padded(static: torch.Tensor, values: torch.Tensor, bucket: int) -> None:
    """A graph's static input: rows 0..n-1 of ``static`` take ``values`` [n, ...], rows n..bucket-1 (padding)
    are zeroed (for token ids: id 0, a valid one), so a replay never depends on the previous call's input."""
    rows = values.shape[0]
    static[:rows].copy_(values)
    static[rows:bucket].zero_()


@contextlib.contextmanager
def collector_paused():
    """One collection of Python's cyclic garbage, then none until the block ends (a no-op inside another such
    block, or with the collector off): a set of captures pays for one collection (~0.1 s at full size, with a
    loaded model's objects to walk) instead of one per graph."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", pool=None, stream: "torch.cuda.Stream | None" = None):
    """``torch.cuda.graph(graph, pool, stream)`` with Python's cyclic garbage collector kept out of the capture.

    torch (>= 2.9) no longer collects garbage before a capture, so the collector may run in the middle of one,
    whenever the captured Python code has allocated enough objects: it then frees whatever dead cycles hold, e.g.
    an earlier engine with its graphs, pinned host buffers and events, and those frees call CUDA (event records
    and queries on other streams, graph and pool teardown) in a way a capturing stream forbids: "operation not
    permitted when stream is capturing", and the capture is invalidated. Hence: collect first, and no collection
    until the capture ends (``collector_paused``; a set of captures inside one collects once). ``thread_local``:
    other threads of the process (an engine loop, a response thread) may keep launching and allocating on their
    own streams while this thread captures."""
    with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield


@torch.inference_mode()
def capture_buckets(buckets, body, graphs: dict, outputs: dict, pool=None):
    """One graph of ``body(bucket)`` per bucket into ``graphs``/``outputs``, largest first so that the smaller
    ones reuse its memory, all in one pool (``pool``: another set's, or None for a new one); returns the pool."""
    with collector_paused():
        for bucket in reversed(buckets):
            body(bucket)  # compiles the Triton kernels of this size and settles lazy state before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool=pool):
                outputs[bucket] = body(bucket)
            pool = graph.pool()
            graphs[bucket] = graph
    torch.cuda.synchronize()
    return pool
