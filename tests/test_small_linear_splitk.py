"""small_linear's split-K launch (``kernels.small_linear``: ``split_plan``, partials + the last program's ticketed
reduction in one launch) against the torch composition and against the one-pass kernel (``split_k=1``).

CPU (Triton's interpreter, fp32/fp16): small shapes with ragged M, N and K edges and 2-3 K slices, every
fusion; the result equals the torch reference within the kernels' tolerances and the one-pass kernel within
rounding; a second call, its scratch poisoned first, gives the same bits; the tile counters are back at 0.
The split plan at the predictor's dimensions (pure arithmetic). The interpreter runs programs one after
another, so it checks the ticket logic but not the memory ordering between SMs: the kernel compiled for sm_90
(no GPU needed) shows the ordering instructions in place, and the GPU tests (skipped without CUDA) hammer it:
the predictor's layer shapes in bf16 at 1-128 rows, many calls each bit-identical to the first, and a CUDA
graph of them replayed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from omni_triton.graph_buckets import capturing  # noqa: E402
from omni_triton.kernels import small_linear as small_linear_module  # noqa: E402
from omni_triton.kernels.scratch import buffers_of  # noqa: E402
from omni_triton.kernels.small_linear import block_sizes, launch_plan, small_linear, split_plan  # noqa: E402
from omni_triton.models.layers.fast_kernels import set_linear_launch  # noqa: E402
from omni_triton.models.layers.norm import RMSNorm  # noqa: E402
from test_code_predictor_kernels import DEVICE, SMALL, random_predictor, rel_error, tolerance  # noqa: E402

# (spelled out here: benchmarks/gpu_tests.sh finds the GPU test files by this condition)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the split-K kernel at full size)")

VARIANTS = ["plain", "norm", "gated", "residual", "gated-norm", "norm-fp32-out"]
# (rows, K, N, split_k): narrow tiles (BLOCK_N 16, BLOCK_K 256; 3 ragged K steps, the plan's own split count);
# two row blocks of 64 (the second ragged), a slice per K step; wide tiles (BLOCK_N 32, BLOCK_K 128; 33
# column blocks, the last ragged; slices of 2 steps and 1), slow in the interpreter: two fusions only
NARROW, ROW_BLOCKS, WIDE = (5, 700, 40, None), (70, 300, 24, 3), (3, 300, 1040, 2)
CASES = ([(variant, shape) for variant in VARIANTS for shape in (NARROW, ROW_BLOCKS)]
         + [(variant, WIDE) for variant in ("residual", "gated-norm")])
# the predictor's linears: (K, N, variant) of qkv, o, gate/up, down, lm_head
PREDICTOR = [(1024, 4096, "norm"), (2048, 1024, "residual"), (1024, 3072, "gated-norm"), (3072, 1024, "residual"),
             (1024, 2048, "norm-fp32-out")]


def layer_call(variant: str, rows: int, depth: int, cols: int, dtype: torch.dtype, seed: int):
    """(run(split_k, gemv=False, **more small_linear options) -> small_linear's output, the torch composition's
    output) for one fusion ``variant``."""
    gen = torch.Generator().manual_seed(seed)
    gated, norm = "gated" in variant, "norm" in variant
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(2 * cols if gated else cols, depth, generator=gen) / depth ** 0.5).to(DEVICE, dtype)
    kwargs = {}
    want = x
    if norm:
        rms = RMSNorm(depth, 1e-6)
        rms.weight.data = 1 + 0.1 * torch.randn(depth, generator=gen)
        rms = rms.to(DEVICE, dtype)
        kwargs.update(norm_weight=rms.weight, eps=rms.eps)
        want = rms(x)
    want = F.linear(want, weight)
    if gated:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
        kwargs.update(gated=True)
    if variant == "residual":
        residual = torch.randn(rows, cols, generator=gen).to(DEVICE, dtype)
        want = residual + want
        kwargs.update(residual=residual)
    if variant == "norm-fp32-out":
        want = want.float()
        kwargs.update(out_dtype=torch.float32)
    return (lambda split_k, gemv=False, **options: small_linear(x, weight, split_k=split_k, gemv=gemv, **kwargs,
                                                                **options)), want


def splits_of(rows: int, depth: int, cols: int, variant: str, split_k: int | None) -> int:
    return split_plan(rows, cols, depth, block_sizes(rows, cols, depth), "norm" in variant, "gated" in variant,
                      split_k)[0]


def assert_within_rounding(got: torch.Tensor, one_pass: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the one-pass kernel up to a few roundings of ``dtype`` (only the fp32 sum order differs)."""
    ulp = torch.finfo(dtype).eps
    scale = float(one_pass.abs().max())
    torch.testing.assert_close(got.float(), one_pass.float(), rtol=8 * ulp, atol=8 * ulp * scale)


def counters_all_zero() -> bool:
    return all(not bool(t.any()) for t in buffers_of("small_linear") if t.dtype == torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant,shape", CASES, ids=[f"{v}-{'x'.join(map(str, s))}" for v, s in CASES])
def test_split_k_equals_the_reference_and_the_one_pass_kernel(dtype, variant, shape):
    rows, depth, cols, split_k = shape
    assert splits_of(rows, depth, cols, variant, split_k) > 1  # else the split path would not run
    run, want = layer_call(variant, rows, depth, cols, dtype, seed=rows)
    one_pass, got = run(1), run(split_k)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_error(got, want) < tolerance(dtype)
    assert_within_rounding(got, one_pass, dtype)
    assert counters_all_zero()
    for scratch in buffers_of("small_linear"):  # the next call must not read what this one left
        if scratch.dtype == torch.float32:
            scratch.fill_(float("nan"))
    assert torch.equal(run(split_k), got)
    assert counters_all_zero()


def test_the_scratch_made_under_inference_mode_is_a_normal_tensor():
    """An engine's first split-K call runs under inference mode; the scratch it makes is shared with every later
    caller, which may run outside that mode (seen on the H200: the poisoning above failed after the GPU tests that
    run engines, "Inplace update to inference tensor outside InferenceMode")."""
    numel = 12345  # a size no other test uses: made here
    with torch.inference_mode():
        scratch = small_linear_module.workspace(torch.device(DEVICE), torch.float32, numel)
    assert not scratch.is_inference()
    scratch.fill_(float("nan"))
    scratch.zero_()


def test_launch_plan_follows_the_h200_tile_sweep():
    """Wide outputs: split at 1-2 rows, else one pass in K steps of 256 (3 stages); narrow outputs: split up to
    SPLIT_MAX_ROWS rows, one pass in K steps of 256 (4 stages) above; fp32 tiles: 2 stages."""
    qkv, o = (1024, 4096), (2048, 1024)
    for rows in (1, 2):
        assert launch_plan(rows, qkv[1], qkv[0], True, False)[1] > 1
    blocks, splits, k_per_split, stages = launch_plan(16, qkv[1], qkv[0], True, False)
    assert (blocks, splits, k_per_split, stages) == ((16, 32, 256), 1, 1024, 3)
    assert launch_plan(16, o[1], o[0], False, False)[1] > 1  # narrow: still split
    blocks, splits, k_per_split, stages = launch_plan(64, o[1], o[0], False, False)
    assert (blocks, splits, k_per_split, stages) == ((64, 16, 256), 1, 2048, 4)
    assert launch_plan(64, o[1], o[0], False, False, element_size=4)[3] == 2
    assert launch_plan(16, qkv[1], qkv[0], True, False, split_k=3)[1] == 3  # a forced count still splits


def test_split_k_rejects_a_count_below_one():
    with pytest.raises(ValueError, match="split_k"):
        small_linear(torch.zeros(1, 16), torch.zeros(16, 16), split_k=0)


@pytest.mark.parametrize("rows", [1, 2])
def test_split_plan_launches_hundreds_of_programs_for_a_few_rows(rows):
    for depth, cols, variant in PREDICTOR:
        block_m, block_n, block_k = blocks = block_sizes(rows, cols, depth)
        splits, k_per_split = split_plan(rows, cols, depth, blocks, "norm" in variant, "gated" in variant)
        programs = -(-cols // block_n) * -(-rows // block_m) * splits
        assert 384 <= programs <= 1024, (depth, cols, programs)
        assert k_per_split % block_k == 0 and (splits - 1) * k_per_split < depth <= splits * k_per_split


def test_split_plan_keeps_one_pass_where_splits_cost_more_than_they_bring():
    # 64 rows: every program of a norm layer would re-read all of x, as many bytes as its share of W
    for depth, cols, variant in PREDICTOR:
        if "norm" in variant:
            assert splits_of(64, depth, cols, variant, None) == 1, (depth, cols)
    assert splits_of(32, 2048, 1024, "residual", None) == 8  # no norm: partials 1 MB against 4 MB of W
    assert splits_of(64, 2048, 1024, "residual", None) == 1  # past SPLIT_MAX_ROWS (measured slower split)
    assert splits_of(1, 64, 4096, "plain", None) == 1  # one K step: nothing to split
    assert splits_of(1, 2048, 1024, "plain", 3) == 3  # forced


def test_set_linear_launch_reaches_every_linear_of_the_fused_frame(monkeypatch):
    predictor = random_predictor(SMALL, torch.float32, groups=2)  # one predictor step
    real, seen = small_linear_module.small_linear, []

    def recording(*args, split_k, gemv, **kwargs):
        seen.append((split_k, gemv))
        return real(*args, split_k=split_k, gemv=gemv, **kwargs)

    monkeypatch.setattr(small_linear_module, "small_linear", recording)
    hidden = torch.randn(2, SMALL["hidden_size"], device=DEVICE)
    # split_k None: the split plan's count
    for launch, wanted in (("one-pass", (1, False)), ("split-k", (None, False)), ("gemv", (None, True))):
        set_linear_launch(predictor, launch)
        seen.clear()
        predictor.predict_with_kernels(hidden, hidden)
        assert seen == [wanted] * (4 * SMALL["num_layers"] + 1)  # qkv, o, gate/up, down per layer; lm_head
    with pytest.raises(ValueError, match="linear launch must be one of one-pass, split-k, gemv"):
        set_linear_launch(predictor, "splitk")


# Compiles the split kernel for sm_90 (no GPU needed: Triton's own compiler, outside the interpreter) and prints
# the PTX lines that order the partials and the ticket.
SM90_PTX = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omni_triton.kernels.small_linear import _small_linear_kernel as kernel
names = kernel.arg_names
signature = {name: "constexpr" for name in names}
signature.update(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", norm_weight_ptr="*bf16", residual_ptr="*bf16",
                 partial_ptr="*fp32", counter_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32",
                 stride_xm="i32", stride_wn="i32", stride_om="i32", stride_rm="i32", eps="fp32")
constants = dict(NORM=True, GATED=True, RESIDUAL=True, SPLITS=4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                 NORM_BLOCK=512, PRECISION="tf32")
aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "k_per_split")]
source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()},
                   attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
for line in compiled.asm["ptx"].splitlines():
    if re.search(r"\\b(atom|bar\\.sync|st\\.global|ld\\.global\\.cg)", line):
        print(line.strip())
"""


def sm90_output(script: str) -> list[str]:
    """The lines ``script`` prints, run outside the interpreter (Triton's own compiler: no GPU needed); skips where
    no Triton CUDA backend is installed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode and "backend" in done.stderr.lower():
        pytest.skip(f"no Triton CUDA backend to compile with: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def assert_ticket_orders_partials(lines: list[str]) -> None:
    """In a split kernel's PTX lines: every partial store (L2 only) before the barrier that precedes the one acq_rel
    atomic at GPU scope, the reduction's loads (L2 only) after it."""
    atomics = [i for i, line in enumerate(lines) if "atom." in line]
    assert len(atomics) == 1 and "atom.global.gpu.acq_rel.add" in lines[atomics[0]], lines
    ticket = atomics[0]
    partial_stores = [i for i, line in enumerate(lines) if "st.global.cg" in line]
    assert partial_stores and max(partial_stores) < ticket
    assert any("bar.sync" in line for line in lines[max(partial_stores):ticket])
    partial_loads = [i for i, line in enumerate(lines) if "ld.global.cg" in line]
    assert partial_loads and min(partial_loads) > ticket


def test_the_ticket_orders_the_partials_in_the_compiled_kernel():
    """What the interpreter cannot show: on the GPU, every thread's partial stores (L2 only) come before the
    barrier that precedes the one acq_rel atomic at GPU scope, and the reduction's loads (L2 only) after it."""
    assert_ticket_orders_partials(sm90_output(SM90_PTX))


# ---------------------------------------------------------------------------------------------- GPU

@cuda
@pytest.mark.parametrize("rows", [1, 2, 8, 64, 128])
def test_split_k_at_released_dims_in_bf16_is_right_and_repeatable(rows):
    """Every call bit-identical to the first: a partial read before its writer's store was visible (the ticket's
    release/acquire, the .cg loads) would show as a call that differs."""
    for depth, cols, variant in PREDICTOR:
        run, want = layer_call(variant, rows, depth, cols, torch.bfloat16, seed=rows)
        first, one_pass = run(None), run(1)
        assert rel_error(first, want) < 1e-2, (depth, cols, variant)
        assert_within_rounding(first, one_pass, torch.bfloat16)
        for call in range(200):
            assert torch.equal(run(None), first), (depth, cols, variant, call)
        assert counters_all_zero()


@cuda
def test_split_k_replays_under_a_cuda_graph():
    """The predictor's five linears captured once (after an eager call made the scratch) and replayed: the same
    bits as the eager calls every time, and the counters at 0 between replays."""
    rows = 2
    calls = [layer_call(variant, rows, depth, cols, torch.bfloat16, seed=i)
             for i, (depth, cols, variant) in enumerate(PREDICTOR)]
    eager = [run(None) for run, _ in calls]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):  # no garbage collection inside the capture (issue 20)
        captured = [run(None) for run, _ in calls]
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)
        assert counters_all_zero()
