"""Work that can run beside the main stream's: forked onto a second CUDA stream, joined before its result is read.

The talker's MoE block has two independent halves after its packed input projection: the shared expert's
SiLU-and-mul and down projection (microseconds at 64 rows) and the routed experts (routing, the sorted
layout, two grouped GEMMs: ~90 us, reading HBM at ~3.5 TB/s). On one stream the shared half sits on the
critical path of each of the 20 layers; on a side stream it runs under the routed GEMMs. Under CUDA-graph
capture the fork and join become the graph's edges (a stream forked from the capturing one is captured with
it, and its allocations come from the graph's pool), so a replay runs the two branches in parallel as well.

Off CUDA (the CPU path, Triton's interpreter in tests), or made with ``enabled=False``, a branch runs inline:
``with branch:`` and ``join()`` do nothing.
"""

from __future__ import annotations

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, made on first use and shared by every layer (layers run one after another,
    so their branches never overlap each other)."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class SideBranch:
    """``with branch: ...`` enqueues the block on the side stream after everything the current stream has
    enqueued so far; ``branch.join()`` makes the current stream wait for it. Tensors made inside the block are
    allocated for the side stream: safe to read on the current stream after ``join`` and to free there, since
    the side stream's next work (the next fork) waits for the current stream first."""

    def __init__(self, like: torch.Tensor, enabled: bool = True):
        self.stream = side_stream(like.device) if enabled and like.is_cuda else None
        self._context = None

    def __enter__(self) -> SideBranch:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
