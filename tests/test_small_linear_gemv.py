"""small_linear's multiply-add launch for few rows (``gemv=True``: ``kernels.small_linear._gemv_kernel``) against
the torch composition and against the one-pass MMA kernel.

CPU (Triton's interpreter, fp32/fp16): every fusion at ragged shapes (columns not a multiple of the block, K not
a multiple of the chunk; 1, 5 and 16 rows: the kernel takes any row count, ``GEMV_MAX_ROWS`` is where it stops
paying), the block plan at the predictor's dimensions, and the fall-through to the MMA kernels past
``GEMV_MAX_ROWS``. GPU (skipped without CUDA): the predictor's five linears in bf16 at 1-2 rows, and under a
CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from omni_triton.graph_buckets import capturing  # noqa: E402
from omni_triton.kernels import small_linear as small_linear_module  # noqa: E402
from omni_triton.kernels.small_linear import GEMV_MAX_ROWS, gemv_blocks  # noqa: E402
from test_code_predictor_kernels import rel_error, tolerance  # noqa: E402
from test_small_linear_splitk import PREDICTOR, VARIANTS, assert_within_rounding, layer_call  # noqa: E402

# (spelled out here: benchmarks/gpu_tests.sh finds the GPU test files by this condition)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GEMV kernel at full size)")

# (rows, K, N): one row, ragged K (3 chunks, the last partial) and N (not a multiple of the column block);
# 5 rows (padded to 8); 16 rows
SHAPES = [(1, 700, 42), (5, 300, 26), (16, 96, 11)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_gemv_equals_the_reference_and_the_one_pass_kernel(dtype, variant, shape, monkeypatch):
    rows, depth, cols = shape
    monkeypatch.setattr(small_linear_module, "GEMV_MIN_PROGRAMS", 4)  # several column blocks at these sizes
    monkeypatch.setattr(small_linear_module, "GEMV_MAX_ROWS", 16)
    launched = []
    real_kernel = small_linear_module._gemv_kernel
    monkeypatch.setattr(small_linear_module, "_gemv_kernel", RecordingKernel(real_kernel, launched))
    run, want = layer_call(variant, rows, depth, cols, dtype, seed=rows)
    got = run(None, gemv=True)
    assert launched, "the GEMV kernel did not run"
    _, block_n, block_k = gemv_blocks(rows, cols, depth)
    assert cols % block_n and depth % block_k  # the ragged edges are exercised
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_error(got, want) < tolerance(dtype)
    assert_within_rounding(got, run(1), dtype)


class RecordingKernel:
    """The kernel, launched as usual, with each launch's grid noted."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def test_gemv_hands_more_rows_to_the_mma_kernels(monkeypatch):
    launched = []
    monkeypatch.setattr(small_linear_module, "_gemv_kernel",
                        RecordingKernel(small_linear_module._gemv_kernel, launched))
    run, want = layer_call("residual", GEMV_MAX_ROWS + 1, 64, 24, torch.float32, seed=0)
    got = run(None, gemv=True)
    assert not launched
    assert torch.equal(got, run(None))  # exactly the split plan's launch


def test_gemv_blocks_at_the_predictor_dimensions():
    """Thin column blocks (2-8) for a few hundred programs; a chunk of ~4K weights a program; K whole."""
    for depth, cols, _ in PREDICTOR:
        for rows in (1, 2):
            block_m, block_n, block_k = gemv_blocks(rows, cols, depth)
            assert block_m >= rows and 2 <= block_n <= 8 and block_n * block_k <= 4096
            assert cols // block_n >= 128, (depth, cols)
    assert gemv_blocks(1, 4096, 1024)[1:] == (8, 512)  # qkv: 512 programs
    assert gemv_blocks(1, 1024, 3072)[1:] == (2, 2048)  # down: 512 programs of 2 chunks (the second half masked)


# ---------------------------------------------------------------------------------------------- GPU

@cuda
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_at_released_dims_in_bf16(rows):
    for depth, cols, variant in PREDICTOR:
        run, want = layer_call(variant, rows, depth, cols, torch.bfloat16, seed=rows)
        got = run(None, gemv=True)
        assert rel_error(got, want) < 1e-2, (depth, cols, variant)
        assert_within_rounding(got, run(1), torch.bfloat16)
        assert torch.equal(run(None, gemv=True), got)  # no state between calls: the same bits


@cuda
def test_gemv_replays_under_a_cuda_graph():
    calls = [layer_call(variant, 2, depth, cols, torch.bfloat16, seed=i)
             for i, (depth, cols, variant) in enumerate(PREDICTOR)]
    eager = [run(None, gemv=True) for run, _ in calls]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        captured = [run(None, gemv=True) for run, _ in calls]
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- tuned launches

def test_the_tuned_launch_shapes_apply_to_their_shapes_only():
    """``gemv_launch`` / ``pair_gemv_launch``: the H200 sweep's entries where they were measured, the rule with
    4 warps everywhere else."""
    from omni_triton.kernels.fused_moe import PAIR_GEMV_TUNED, pair_gemv_blocks, pair_gemv_launch
    from omni_triton.kernels.small_linear import GEMV_TUNED, gemv_launch

    for (depth, cols, gated), tuned in GEMV_TUNED.items():
        for rows in (1, 2):
            assert gemv_launch(rows, cols, depth, gated) == (rows, *tuned)
    assert gemv_launch(1, 1024, 2048, False) == (1, *gemv_blocks(1, 1024, 2048)[1:], 4)  # predictor o_proj: rule
    assert gemv_launch(1, 3072, 1024, False)[3] == 4  # the gate/up entry is for the gated launch only
    for (kernel, depth, cols), tuned in PAIR_GEMV_TUNED.items():
        assert pair_gemv_launch(kernel, 8, cols, depth) == tuned
    assert pair_gemv_launch("gate_up", 6, 384, 1024) == (*pair_gemv_blocks(6, 384, 1024), 4)  # talker: the rule


@pytest.mark.parametrize("depth,cols,variant", [(1024, 3072, "gated-norm"), (2048, 5120, "plain")])
def test_gemv_at_a_tuned_launch_shape_equals_the_reference(depth, cols, variant):
    """The tuned tiles (8 columns x 1024 of K) in the interpreter: the same result as the torch composition."""
    run, want = layer_call(variant, 1, depth, cols, torch.float32, seed=depth)
    got = run(None, gemv=True)
    assert rel_error(got, want) < tolerance(torch.float32)


@cuda
@pytest.mark.parametrize("rows", [1, 2])
def test_tuned_gemvs_at_the_thinker_dims_in_bf16(rows):
    """The thinker's qkv and o_proj GEMVs (8 warps) and its experts' per-pair GEMVs (8 warps, 2 and 16 columns a
    program) at full size against cuBLAS and the grouped expert GEMMs."""
    from omni_triton.kernels import fused_moe
    from omni_triton.models.layers import moe

    for depth, cols in ((2048, 5120), (4096, 2048)):
        run, want = layer_call("plain", rows, depth, cols, torch.bfloat16, seed=rows)
        got = run(None, gemv=True)
        assert rel_error(got, want) < 1e-2, (depth, cols)
        assert torch.equal(run(None, gemv=True), got)
    gen = torch.Generator().manual_seed(rows)
    num_experts, hidden, inter, top_k = 128, 2048, 768, 8
    x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to("cuda", torch.bfloat16)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to("cuda", torch.bfloat16)
    weights, ids = moe.route(torch.randn(rows, num_experts, generator=gen).to("cuda", torch.bfloat16), top_k, True)
    by_pair = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=True)
    grouped = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights)
    assert rel_error(by_pair, grouped) < 1e-2
    assert rel_error(by_pair, moe.run_experts(x, gate_up, down, ids, weights)) < 1e-2
