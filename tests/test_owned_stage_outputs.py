"""A stage output the orchestrator keeps past its response (``stage_io.owned_copy``): a copy of its own, complete
on return. On the GPU, Triton's buffer goes back to its pool as soon as the last view is dropped, not after the
kernels queued to read it ran; the frames' concatenation queued behind other work then read whatever the pool
put there next (codes that were another request's token ids, after a stage's reload). GPU: the hazard and the
copy (skipped without CUDA); CPU: nothing to copy."""

from __future__ import annotations

import pytest
import torch

from omni_triton.stages.stage_io import owned_copy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_the_host_the_view_is_kept():
    codes = torch.arange(32).reshape(2, 16)
    assert owned_copy(codes) is codes


def _frames_cat_after_the_buffer_is_reused(take) -> torch.Tensor:
    """The orchestrator's pattern: a frames tensor taken from a response (``take``), the stream busy, the
    concatenation queued, the response's buffer reused at once by another writer (Triton's pool, another stream)."""
    device = torch.device("cuda")
    buffer = torch.arange(64, dtype=torch.long, device=device).reshape(4, 16)  # the response's pool memory
    torch.cuda.synchronize()
    # Neither stream is the legacy default stream, which the others would wait for: in the server the writer is
    # another process (tritonserver), which waits for nothing of the orchestrator's.
    busy, writer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(busy):
        frames = take(buffer)
        torch.cuda._sleep(50_000_000)  # the orchestrator's stream behind other work (tens of ms)
        merged = torch.cat([torch.zeros(0, 16, dtype=torch.long, device=device), frames])
    with torch.cuda.stream(writer):  # the pool hands the buffer to the next request at once
        buffer.fill_(100_000)
    torch.cuda.synchronize()
    return merged.cpu()


def _measured(take) -> torch.Tensor:
    """The scenario's second run: the first loads every kernel it launches (CUDA's lazy module loading
    synchronises the device on a kernel's first launch, which would let the queued read run before the write)."""
    _frames_cat_after_the_buffer_is_reused(take)
    return _frames_cat_after_the_buffer_is_reused(take)


@cuda
def test_a_view_kept_past_its_buffer_reads_what_came_next():
    """Why the copy: without it, the queued concatenation reads the next owner's values (the test of the
    hazard itself, so that the one below cannot pass by accident)."""
    assert (_measured(lambda buffer: buffer) == 100_000).all()


@cuda
def test_an_owned_copy_keeps_the_frames_it_was_given():
    expected = torch.arange(64, dtype=torch.long).reshape(4, 16)
    assert torch.equal(_measured(owned_copy), expected)
