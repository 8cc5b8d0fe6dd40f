"""``kernels.wide_linear``: the code predictor's folded qkv and gate/up (+ row scale + SiLU) as a TMA GEMM.

CPU (Triton's interpreter runs the tensor-descriptor kernel, fp32/fp16): plain, gated and gated with the folded
norm's row scale against the torch composition (cuBLAS + ``silu_and_mul``) at ragged rows and depths, both row
tilings; the operands ``tma_ready`` refuses go to cuBLAS; the predictor's folded frame takes the kernel (or not,
by its switch) and equals the module frame. GPU (skipped without CUDA): the released predictor's shapes in bf16
at 8-128 rows, eager and under a CUDA graph with dependent launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from omni_triton.graph_buckets import capturing  # noqa: E402
from omni_triton.kernels import wide_linear as wide_linear_module  # noqa: E402
from omni_triton.kernels.activation import silu_and_mul  # noqa: E402
from omni_triton.kernels.wide_linear import WIDE_MAX_ROWS, takes_tma, tma_ready, wide_linear  # noqa: E402
from omni_triton.models.code_predictor import CodePredictor  # noqa: E402
from omni_triton.models.layers.fast_kernels import KernelSwitch  # noqa: E402
from test_code_predictor_kernels import DEVICE, SMALL, check_frame, rel_error, tolerance  # noqa: E402
from test_small_linear_gemv import RecordingKernel  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TMA at full size)")


def operands(rows: int, depth: int, cols: int, dtype: torch.dtype, gated: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn((2 if gated else 1) * cols, depth, generator=gen) / depth ** 0.5).to(DEVICE, dtype)
    squares = (torch.rand(3, rows, generator=gen) * depth).to(DEVICE)  # three column blocks' partial sums
    return x, weight, squares


def composition(x, weight, gated, input_norm):
    out = F.linear(x, weight)
    return silu_and_mul(out, input_norm=input_norm) if gated else out


@pytest.fixture
def tma_launches(monkeypatch) -> list:
    launched = []
    monkeypatch.setattr(wide_linear_module, "_wide_linear_kernel",
                        RecordingKernel(wide_linear_module._wide_linear_kernel, launched))
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 37, 70])  # 70: one 128-row block (past 64 rows)
@pytest.mark.parametrize("variant", ["plain", "gated", "gated-norm"])
def test_wide_linear_equals_cublas_and_the_activation(dtype, rows, variant, tma_launches):
    gated = variant != "plain"
    depth, cols = (200, 24) if rows < 37 else (136, 40)  # K not a multiple of the K step, N not of the N block
    x, weight, squares = operands(rows, depth, cols, dtype, gated, seed=rows)
    input_norm = (squares, depth, 1e-6) if variant == "gated-norm" else None
    got = wide_linear(x, weight, gated=gated, input_norm=input_norm)
    want = composition(x, weight, gated, input_norm)
    assert len(tma_launches) == 1 and got.shape == (rows, cols) and got.dtype == dtype
    assert rel_error(got, want) < tolerance(dtype), variant
    # tma=False: cuBLAS and the activation kernel, the same values
    assert rel_error(wide_linear(x, weight, gated=gated, input_norm=input_norm, tma=False), want) < tolerance(dtype)
    assert len(tma_launches) == 1


def test_the_served_frame_takes_the_kernel_where_it_won():
    assert [rows for rows in (1, 8, 15, 16, 32, 64, 65, 128) if takes_tma(rows)] == [16, 32, 64]


def test_tma_ready_refuses_what_a_descriptor_cannot_describe(tma_launches):
    x, weight, _ = operands(8, 64, 16, torch.float32, False, seed=1)
    assert tma_ready(x, weight)
    assert not tma_ready(x[:, 1:63], weight[:, 1:63])  # base off the 16-byte grid
    assert not tma_ready(torch.randn(8, 63, device=DEVICE), torch.randn(16, 63, device=DEVICE))  # 252-byte rows
    assert not tma_ready(x.t().contiguous().t(), weight)  # column-major x
    many = torch.randn(WIDE_MAX_ROWS + 1, 64, device=DEVICE)
    assert not tma_ready(many, weight) and not tma_ready(x[:0], weight)
    torch.testing.assert_close(wide_linear(many, weight), F.linear(many, weight))  # cuBLAS for those
    assert not tma_launches
    with pytest.raises(ValueError, match="differ in K"):
        wide_linear(x, weight[:, :32])
    with pytest.raises(ValueError, match="gated epilogue"):
        wide_linear(x, weight, input_norm=(torch.ones(1, 8, device=DEVICE), 64, 1e-6))
    with pytest.raises(ValueError, match="squares"):
        wide_linear(x, torch.cat([weight, weight]), gated=True, input_norm=(torch.ones(1, 7, device=DEVICE), 64, 1e-6))


@pytest.mark.parametrize("tma", [False, True])
def test_folded_frame_through_the_tma_kernel_equals_the_module_frame(monkeypatch, tma, tma_launches):
    """The served launch's folded pre-norms (forced at the small dims) with qkv and gate/up on the TMA kernel (or
    on cuBLAS + the activation, by ``CodePredictor.tma_linears``), against the module frame in fp32."""
    from omni_triton.kernels import small_linear as small_linear_module

    monkeypatch.setattr(small_linear_module, "takes_cublas", lambda rows, cols, residual: not residual)
    monkeypatch.setattr(KernelSwitch, "linear_launch", "gemv")
    monkeypatch.setattr(CodePredictor, "tma_linears", tma)
    monkeypatch.setattr(wide_linear_module, "TMA_MIN_ROWS", 1)  # the small frame's 3-6 rows
    check_frame(SMALL, torch.float32, rows=3, logit_rel=1e-5, groups=4)
    # per fused frame (two: teacher-forced, greedy): gate/up of every layer of every step, qkv but the tables'
    steps, layers = 3, SMALL["num_layers"]
    assert len(tma_launches) == (2 * (2 * steps * layers - (steps - 1)) if tma else 0)


@cuda
@pytest.mark.parametrize("rows", [8, 64, 128])
def test_the_predictors_wide_products_in_bf16_eager_and_captured(rows, tma_launches):
    """qkv (1024 -> 4096) and gate/up (1024 -> 2 x 3072, row scale + SiLU) at the released dims: the kernel equals
    cuBLAS + the activation in bf16, eagerly and replayed from a CUDA graph (dependent launch on)."""
    for cols, gated in ((4096, False), (3072, True)):
        x, weight, squares = operands(rows, 1024, cols, torch.bfloat16, gated, seed=rows + cols)
        input_norm = (squares, 1024, 1e-6) if gated else None
        want = composition(x, weight, gated, input_norm)
        assert rel_error(wide_linear(x, weight, gated=gated, input_norm=input_norm), want) < tolerance(torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            captured = wide_linear(x, weight, gated=gated, input_norm=input_norm)
        x.mul_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(captured, composition(x, weight, gated, input_norm)) < tolerance(torch.bfloat16)
    assert len(tma_launches) == 4
