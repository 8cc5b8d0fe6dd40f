"""small_linear's cuBLAS route for many rows of a wide output (``cublas=True``: ``kernels.small_linear.library_linear``,
the norm kernel + cuBLAS's GEMM + the activation kernel) against the torch composition and the fused kernel.

CPU (Triton's interpreter for the norm and activation kernels, fp32/fp16): every fusion without a residual at a
wide shape takes the route and equals the torch composition and the one-pass kernel within rounding; below the
row limit, narrower, with a residual, with a forced split count or without ``cublas`` the fused kernels run; the
code predictor's fused frame with the route taken (the limits lowered to the small predictor's sizes) equals the
module frame. GPU (skipped without CUDA): the predictor's wide linears in bf16 at 8-128 rows, eager and under a
CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from omni_triton.graph_buckets import capturing  # noqa: E402
from omni_triton.kernels import small_linear as small_linear_module  # noqa: E402
from omni_triton.kernels.small_linear import CUBLAS_MIN_COLS, CUBLAS_MIN_ROWS, takes_cublas  # noqa: E402
from omni_triton.models.code_predictor import CodePredictor  # noqa: E402
from omni_triton.models.layers.fast_kernels import set_linear_launch  # noqa: E402
from test_code_predictor_kernels import DEVICE, SMALL, check_frame, random_predictor, rel_error, tolerance  # noqa: E402
from test_small_linear_gemv import RecordingKernel  # noqa: E402
from test_small_linear_splitk import PREDICTOR, VARIANTS, assert_within_rounding, layer_call  # noqa: E402

# (spelled out here: benchmarks/gpu_tests.sh finds the GPU test files by this condition)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLAS at full size)")

NO_RESIDUAL = [variant for variant in VARIANTS if variant != "residual"]


@pytest.fixture
def fused_launches(monkeypatch) -> list:
    """The fused kernels' launches (MMA and GEMV) while a test runs."""
    launched = []
    for name in ("_small_linear_kernel", "_gemv_kernel"):
        monkeypatch.setattr(small_linear_module, name, RecordingKernel(getattr(small_linear_module, name), launched))
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", NO_RESIDUAL)
def test_the_cublas_route_equals_the_reference_and_the_fused_kernel(dtype, variant, fused_launches):
    rows, depth, cols = CUBLAS_MIN_ROWS + 1, 96, CUBLAS_MIN_COLS
    run, want = layer_call(variant, rows, depth, cols, dtype, seed=rows)
    got = run(None, cublas=True)
    assert not fused_launches, "a fused kernel ran where cuBLAS should"
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_error(got, want) < tolerance(dtype)
    assert_within_rounding(got, run(1), dtype)


@pytest.mark.parametrize("case", ["few rows", "narrow", "residual", "forced split", "off"])
def test_other_calls_keep_the_fused_kernels(case, fused_launches):
    rows = CUBLAS_MIN_ROWS - 1 if case == "few rows" else CUBLAS_MIN_ROWS
    cols = CUBLAS_MIN_COLS - 1 if case == "narrow" else CUBLAS_MIN_COLS
    run, want = layer_call("residual" if case == "residual" else "norm", rows, 64, cols, torch.float32, seed=1)
    options = dict(cublas=case != "off")
    if case == "forced split":
        options.update(split_k=2)
    got = run(options.pop("split_k", None), **options)
    assert fused_launches, case
    assert rel_error(got, want) < tolerance(torch.float32)


def test_takes_cublas_picks_the_predictors_wide_outputs_from_eight_rows():
    for depth, cols, variant in PREDICTOR:
        wide = variant != "residual"  # qkv, gate/up, lm_head; o and down add their residual
        assert takes_cublas(64, cols, variant == "residual") == wide, (depth, cols, variant)
        assert not takes_cublas(2, cols, variant == "residual")  # GEMV's rows
    assert takes_cublas(8, 2048, False) and not takes_cublas(7, 4096, False)


@pytest.mark.parametrize("fold_norms", [False, True])
def test_the_fused_frame_equals_the_module_frame_through_cublas(monkeypatch, fold_norms):
    """The small predictor's qkv, gate/up and lm_head (64-192 columns) routed to cuBLAS, o/down fused; with the
    pre-norms folded (the served default) qkv and gate/up are cuBLAS products of the folded weights and only
    lm_head goes through ``library_linear`` (its norm launch kept)."""
    monkeypatch.setattr(small_linear_module, "CUBLAS_MIN_COLS", 32)
    monkeypatch.setattr(small_linear_module, "CUBLAS_MIN_ROWS", 3)
    monkeypatch.setattr(CodePredictor, "fold_norms", fold_norms)
    routed = []
    real = small_linear_module.library_linear
    monkeypatch.setattr(small_linear_module, "library_linear", lambda *a: routed.append(a[0].shape) or real(*a))
    check_frame(SMALL, torch.float32, rows=3, logit_rel=1e-5, groups=4)
    steps = 2 * 3  # two frames (teacher-forced, then greedy) of 3 predictor steps
    # per step: lm_head, and unless folded qkv and gate/up of every layer, but for the first layer's qkv in the
    # steps after a frame's first (read from the qkv tables)
    unfolded = 2 * SMALL["num_layers"] * steps - 2 * (3 - 1)
    assert len(routed) == steps + (0 if fold_norms else unfolded)


@cuda
@pytest.mark.parametrize("rows", [8, 64, 128])
def test_the_predictors_wide_linears_through_cublas_in_bf16(rows):
    for depth, cols, variant in PREDICTOR:
        if variant == "residual":
            continue
        run, want = layer_call(variant, rows, depth, cols, torch.bfloat16, seed=rows)
        got = run(None, cublas=True)
        assert rel_error(got, want) < tolerance(torch.bfloat16), (depth, cols, variant)
        assert_within_rounding(got, run(1), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            replayed = run(None, cublas=True)
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), (depth, cols, variant)


def test_set_linear_launch_gemv_asks_for_cublas(monkeypatch):
    predictor = random_predictor(SMALL, torch.float32, groups=2)
    seen = []
    real = small_linear_module.small_linear
    monkeypatch.setattr(small_linear_module, "small_linear",
                        lambda *a, cublas=False, **k: seen.append(cublas) or real(*a, cublas=cublas, **k))
    hidden = torch.randn(2, SMALL["hidden_size"], device=DEVICE)
    for launch, wanted in (("gemv", True), ("split-k", False), ("one-pass", False)):
        set_linear_launch(predictor, launch)
        seen.clear()
        predictor.predict_with_kernels(hidden, hidden)
        assert seen and set(seen) == {wanted}, launch
