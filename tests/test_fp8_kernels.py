"""FP8-weight kernels (``kernels.fp8_linear``, ``kernels.fused_moe``'s FP8 path) against the torch dequant reference.

CPU: Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``) on small, ragged shapes with 16 x 16 and 32 x 32
blocks, in fp32 and fp16 (the interpreter's bf16 ``tl.dot`` is wrong, see test_kernels.py). GPU (skipped without
CUDA): the released model's shapes with 128 x 128 blocks in bf16, eager and under a CUDA graph, and the FP8 model
layers through their kernels against the same layers' torch path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from omni_triton.kernels import fused_moe  # noqa: E402
from omni_triton.kernels.fp8_linear import fp8_linear, quantize_act_groups  # noqa: E402
from omni_triton.models.layers import moe  # noqa: E402
from omni_triton.models.quantization import FP8_DTYPE, dequantize_fp8, quantize_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (full-size FP8 shapes)")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def fp8_weight(rows: int, cols: int, block, seed: int, lead=()):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(*lead, rows, cols, generator=gen) / cols ** 0.5
    quantized, scale_inv = quantize_fp8(weight, block)
    return quantized.to(DEVICE), scale_inv.to(DEVICE)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,depth,cols,block", [(1, 64, 48, (16, 16)), (5, 96, 70, (32, 32)),
                                                   (37, 80, 33, (16, 16))])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_linear_matches_dequantized_linear(dtype, rows, depth, cols, block, bias):
    weight, scale_inv = fp8_weight(cols, depth, block, seed=rows)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, dtype)
    bias_tensor = torch.randn(cols, generator=gen).to(DEVICE, dtype) if bias else None
    want = F.linear(x, dequantize_fp8(weight, scale_inv, block, dtype), bias_tensor)
    got = fp8_linear(x, weight, scale_inv, block, bias_tensor)
    assert got.dtype == dtype and got.shape == (rows, cols)
    assert rel_error(got, want) < tolerance(dtype)


def test_w8a16_linear_takes_leading_dims_and_refuses_plain_weights():
    weight, scale_inv = fp8_weight(32, 64, (16, 16), seed=1)
    x = torch.randn(2, 3, 64).to(DEVICE)
    got = fp8_linear(x, weight, scale_inv, (16, 16))
    want = F.linear(x, dequantize_fp8(weight, scale_inv, (16, 16)))
    assert got.shape == (2, 3, 32) and rel_error(got, want) < 1e-5
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, weight.float(), scale_inv, (16, 16))


def test_activation_groups_quantize_to_fp8_with_row_group_scales():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 72, generator=gen) * torch.linspace(0.1, 10, 72)).to(DEVICE)
    quantized, scales = quantize_act_groups(x, 32)
    assert quantized.dtype == FP8_DTYPE and scales.shape == (6, 3)
    group_max = torch.stack([x[:, g * 32:(g + 1) * 32].abs().amax(dim=1) for g in range(3)], dim=1)
    torch.testing.assert_close(scales, group_max / 448.0)
    scaled = x / scales.repeat_interleave(32, dim=1)[:, :72]
    want = scaled.clamp(-448, 448).to(FP8_DTYPE)
    mismatch = quantized.float() != want.float()
    if DEVICE == "cpu":
        # triton 3.9's interpreter loses the carry where fp32 -> e4m3 rounds up to a power of two (-127.7 gives -64,
        # not -128); the GPU's conversion instruction does not
        mismatch &= torch.log2(want.float().abs()).frac() != 0
    assert not mismatch.any()


@pytest.mark.parametrize("rows", [1, 20])
def test_w8a8_linear_matches_quantized_activations_reference(rows):
    block = (32, 32)
    weight, scale_inv = fp8_weight(48, 96, block, seed=3)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    quantized, scales = quantize_act_groups(x, block[1])
    x_restored = quantized.float() * scales.repeat_interleave(block[1], dim=1)[:, :96]
    want = F.linear(x_restored, dequantize_fp8(weight, scale_inv, block))
    got = fp8_linear(x, weight, scale_inv, block, act_quant=True)
    assert rel_error(got, want) < 1e-5
    # and close to the unquantized activations' product: FP8's rounding of x, no more
    assert rel_error(got, F.linear(x, dequantize_fp8(weight, scale_inv, block))) < 0.06


# (rows, K, N, block): K not a multiple of the block (a partial last scale column) nor of the K step, N not a
# multiple of the column block; the GEMV at 1-2 rows, split-K at 3-16 (GEMV_ROWS = 2, SMALL_MAX_ROWS = 16)
SMALL_ROWS = [(1, 200, 70, (32, 32)), (2, 96, 42, (16, 16)), (3, 200, 70, (32, 32)), (9, 112, 33, (16, 16)),
              (16, 200, 70, (32, 32))]


@pytest.fixture
def launches(monkeypatch):
    """The FP8 linear kernels, launched as usual, with each launch noted: [(kernel, grid)]."""
    from omni_triton.kernels import fp8_linear as module

    noted = []

    class Noting:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(module, name)

        def __getitem__(self, grid):
            noted.append((self.name, grid))
            return self.kernel[grid]

    for name in ("_fp8_gemv_kernel", "_fp8_linear_kernel"):
        monkeypatch.setattr(module, name, Noting(name))
    return noted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SMALL_ROWS, ids=["x".join(map(str, s[:3])) for s in SMALL_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_small_row_launches_match_the_dequantized_linear(dtype, shape, bias, launches, monkeypatch):
    """The GEMV (1-2 rows) and the split tiled kernel (3-16 rows) against the torch path's product and against the
    tiled kernel in one pass (``small_rows=False``, the launch before them)."""
    from omni_triton.kernels import fp8_linear as module

    monkeypatch.setattr(module, "GEMV_CHUNK", 128)  # several chunks at these sizes (the last one partial)
    rows, depth, cols, block = shape
    weight, scale_inv = fp8_weight(cols, depth, block, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, dtype)
    bias_tensor = torch.randn(cols, generator=gen).to(DEVICE, dtype) if bias else None
    want = F.linear(x, dequantize_fp8(weight, scale_inv, block, dtype), bias_tensor)
    got = fp8_linear(x, weight, scale_inv, block, bias_tensor)
    (kernel, grid), = launches
    if rows <= module.GEMV_ROWS:
        assert kernel == "_fp8_gemv_kernel" and grid[0] > 1
    else:
        assert kernel == "_fp8_linear_kernel" and grid[2] > 1  # K in slices
    launches.clear()
    one_pass = fp8_linear(x, weight, scale_inv, block, bias_tensor, small_rows=False)
    assert [(kernel, grid[2]) for kernel, grid in launches] == [("_fp8_linear_kernel", 1)]
    assert got.dtype == dtype and got.shape == (rows, cols)
    assert rel_error(got, want) < tolerance(dtype)
    assert rel_error(got, one_pass) < tolerance(dtype)


def test_split_launch_repeats_its_bits_and_leaves_its_tickets_at_zero():
    from omni_triton.kernels.scratch import buffers_of

    block = (16, 16)
    weight, scale_inv = fp8_weight(40, 160, block, seed=5)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    first = fp8_linear(x, weight, scale_inv, block)
    assert torch.equal(fp8_linear(x, weight, scale_inv, block), first)
    assert buffers_of("fp8_linear") and all(not bool(t.any()) for t in buffers_of("fp8_linear"))


def test_w8a8_takes_the_split_launch_at_few_rows(launches):
    block = (32, 32)
    weight, scale_inv = fp8_weight(48, 192, block, seed=6)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = fp8_linear(x, weight, scale_inv, block, act_quant=True)
    assert [kernel for kernel, _ in launches] == ["_fp8_linear_kernel"] and launches[0][1][2] > 1  # no GEMV
    quantized, scales = quantize_act_groups(x, block[1])
    x_restored = quantized.float() * scales.repeat_interleave(block[1], dim=1)
    assert rel_error(got, F.linear(x_restored, dequantize_fp8(weight, scale_inv, block))) < 1e-5


def test_fp8_linear_takes_the_small_row_launches_under_the_gemv_launch_only(launches, monkeypatch):
    """As bf16's decode-step linears: with the fused steps on and ``linear_launch`` "gemv" (the default)."""
    from omni_triton.models.layers.fast_kernels import KernelSwitch
    from omni_triton.models.layers.fp8 import Fp8Linear

    monkeypatch.setattr(KernelSwitch, "kernels_for", lambda self, x: self.use_kernels)
    linear = Fp8Linear(64, 32, False, (16, 16)).to(DEVICE)
    weight, scale_inv = fp8_weight(32, 64, (16, 16), seed=8)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.weight_scale_inv.copy_(scale_inv)
    x = torch.randn(1, 64).to(DEVICE)

    def kernel_of_one_call() -> str:
        launches.clear()
        with torch.no_grad():
            linear(x)
        (kernel, _), = launches
        return kernel

    assert kernel_of_one_call() == "_fp8_gemv_kernel"
    linear.linear_launch = "split-k"
    assert kernel_of_one_call() == "_fp8_linear_kernel"
    linear.linear_launch, linear.use_fused_steps = "gemv", False
    assert kernel_of_one_call() == "_fp8_linear_kernel"


# Compiles the small-row kernels for sm_90 (no GPU needed: Triton's own compiler, outside the interpreter) at the
# thinker's qkv (K 2048, 5120 columns, 128 x 128 blocks, bf16), and prints per kernel the PTX lines that order the
# split launch's partials and ticket, and the GEMV's global loads and barriers.
SM90_PTX = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omni_triton.kernels import fp8_linear


def compiled(kernel, types, constants, warps, stages):
    names = kernel.arg_names
    signature = {name: "constexpr" for name in names}
    signature.update(types)
    # what the launcher tells the compiler of pointers and of integers that are multiples of 16 at these shapes
    aligned = [n for n in types if n.endswith("_ptr") or n in ("stride_xm", "stride_wn", "stride_om", "depth",
                                                                 "stride_ht", "stride_we", "stride_ot", "hidden",
                                                                 "stride_xt", "inter")]
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


common = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", cols="i32",
              stride_xm="i32", stride_wn="i32", stride_wsn="i32", stride_om="i32")
split = compiled(fp8_linear._fp8_linear_kernel, dict(common, x_scale_ptr="*bf16", partial_ptr="*fp32",
                 counter_ptr="*i32", rows="i32", depth="i32", k_per_split="i32", stride_xsm="i32"),
                 dict(BLOCK_ROWS=128, BLOCK_COLS=128, ACT_QUANT=False, HAS_BIAS=True, SPLITS=3, BLOCK_M=16,
                      BLOCK_N=32, BLOCK_K=128, PRECISION="tf32", PDL=True), 4, 3)
block_n, groups = fp8_linear.gemv_chunk(2, 5120, 2048, 128)
gemv = compiled(fp8_linear._fp8_gemv_kernel, common,
                dict(K=2048, BLOCK_ROWS=128, BLOCK_COLS=128, HAS_BIAS=False, TWO_ROWS=True, BLOCK_N=block_n,
                     GROUPS=groups, SPAN=128, PDL=True, PREFETCH_LINES=16), 4, 1)
from omni_triton.kernels import fused_moe
pair = compiled(fused_moe._down_weighted_gemv_kernel,
                dict(h_ptr="*bf16", w_ptr="*fp8e4nv", ids_ptr="*i32", pair_weights_ptr="*bf16", out_ptr="*bf16",
                     hidden="i32", stride_ht="i32", stride_we="i32", stride_wn="i32", stride_ot="i32",
                     w_scale_ptr="*fp32", stride_wse="i32", stride_wsn="i32"),
                dict(K=768, BLOCK_N=16, BLOCK_K=256, PDL=True, FP8=True, BLOCK_ROWS=128, BLOCK_COLS=128, SPAN=128), 8, 1)
block_n, block_k, warps = fused_moe.pair_gemv_launch("gate_up", 8, 768, 2048)
gate_up = compiled(fused_moe._gate_up_silu_gemv_kernel,
                   dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ids_ptr="*i32", out_ptr="*bf16", inter="i32", stride_xt="i32",
                        stride_we="i32", stride_wn="i32", stride_ot="i32", w_scale_ptr="*fp32", stride_wse="i32",
                        stride_wsn="i32", gate_blocks="i32"),
                   dict(K=2048, TOP_K=8, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, FP8=True, BLOCK_ROWS=128,
                        BLOCK_COLS=128, SPAN=128), warps, 1)
for name, kernel in (("split", split), ("gemv", gemv), ("pair", pair), ("gate_up", gate_up)):
    for line in kernel.asm["ptx"].splitlines():
        if re.search(r"\\b(atom|bar\\.sync|st\\.global|ld\\.global)", line):
            print(name, line.strip())
print("gemv chunks", 2048 // (groups * 128))
"""


def test_small_row_kernels_compile_for_sm90():
    """What the interpreter cannot show. The split launch: every thread's partial stores (L2 only) before the
    barrier that precedes its one acq_rel atomic at GPU scope, the sum's loads (L2 only) after it. The GEMV at two
    rows: its weights and x read in 16-byte vectors, one scale load per column and group, and no register exchange
    through shared memory per chunk (a barrier or two for the final sums, fewer than its chunks). The experts'
    per-pair FP8 GEMVs: one scale load per row and group of a chunk, and the gate/up halves' weights all in flight at
    once.

    Compiled by the Triton installed here; the GPU machine's may be older (torch 2.11's wheel: Triton 3.6, whose
    layouts differ: a [rows, groups, span] tile with its scales broadcast along span loaded every scale once per
    weight a thread holds, 16 times). To check another version without a GPU::

        pip install --target /tmp/tri36 triton==3.6.0
        PYTHONPATH=/tmp/tri36 python -m pytest -q tests/test_fp8_kernels.py -k sm90
    """
    from test_small_linear_splitk import assert_ticket_orders_partials, sm90_output

    lines = sm90_output(SM90_PTX)
    assert_ticket_orders_partials([line for line in lines if line.startswith("split ")])
    gemv = [line for line in lines if line.startswith("gemv ")]
    chunks = int(lines[-1].split()[-1])
    assert chunks > 1
    assert sum("ld.global.v4" in line for line in gemv) >= 2 * chunks  # weights and x, every chunk
    assert sum("bar.sync" in line for line in gemv) < chunks
    # 8 chunks of [8 columns, 2 groups, 128]: a scale load per column and group (one a thread), not one per weight
    assert sum("ld.global.b32" in line for line in gemv) <= chunks
    pair = [line for line in lines if line.startswith("pair ")]
    assert sum("ld.global.v4" in line for line in pair) >= 3
    # the thinker's per-pair down GEMV (K 768 in 3 chunks of two 128-wide groups): a scale load per row and group
    # (and the pair's expert id), not one per weight (the per-element gather loaded 48 scales)
    assert sum("ld.global.b32" in line for line in pair) <= 3 * 2 + 1
    # the thinker's per-pair gate/up GEMV (K 2048 in one chunk a half): the up half's weights loaded before the
    # gate's sums are exchanged across warps (a barrier between them would hold the up loads back until then)
    gate_up = [line for line in lines if line.startswith("gate_up ")]
    weight_loads = [i for i, line in enumerate(gate_up) if "ld.global.v4" in line]
    barriers = [i for i, line in enumerate(gate_up) if "bar.sync" in line]
    assert len(weight_loads) >= 2 and barriers and max(weight_loads) < min(barriers)


# The experts' grouped FP8 GEMMs compiled for sm_90 at the thinker's shapes (bf16, 128 x 128 blocks, a decode
# step's 16-row tiles), the scales after each K tile's dot and on the weights: per kernel, its PTX's conversions
# and multiplies.
SM90_GROUPED = SM90_PTX.split("common = dict")[0] + """
import collections
from omni_triton.kernels import fused_moe
common = dict(w_ptr="*fp8e4nv", out_ptr="*bf16", sorted_pairs_ptr="*i32", block_expert_ptr="*i32", num_pairs="i32",
              hidden="i32", inter="i32", stride_we="i32", stride_wn="i32", stride_ot="i32", w_scale_ptr="*fp32",
              stride_wse="i32", stride_wsn="i32")
for after in (True, False):
    consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PRECISION="tf32", PDL=True, FP8=True, BLOCK_ROWS=128,
                  BLOCK_COLS=128, stride_wk=1, SCALE_AFTER_DOT=after, BF16_ASM=after, EVEN_K=True)
    kernels = (("down", fused_moe._down_weighted_kernel, dict(common, h_ptr="*bf16", pair_weights_ptr="*bf16",
                                                                stride_ht="i32"), consts),
               ("gate_up", fused_moe._gate_up_silu_kernel, dict(common, x_ptr="*bf16", stride_xt="i32",
                                                                 gate_blocks="i32"), dict(consts, TOP_K=8)))
    for name, kernel, types, constants in kernels:
        ptx = compiled(kernel, types, constants, 4, 4).asm["ptx"]
        ops = collections.Counter(line.split()[0] for line in ptx.splitlines()
                                  if re.match(r"\\s*(cvt|mul|fma|mma|prmt)\\.", line))
        print("after" if after else "weights", name, *(f"{op}={n}" for op, n in sorted(ops.items())))
"""


def test_grouped_fp8_gemms_compile_for_sm90_without_per_weight_conversions():
    """The grouped GEMMs with the scales after the dot: each e4m3 weight to bf16 by prmt and a packed bf16 multiply
    (no conversion instruction, no fp32 multiply per weight: the scales multiply the partial sums, an fma per output);
    with the scales on the weights, e4m3 -> f16 -> f32, times the scale, -> bf16 per weight (what it was)."""
    from test_small_linear_splitk import sm90_output

    lines = sm90_output(SM90_GROUPED)
    ops = {tuple(line.split()[:2]): dict(op.split("=") for op in line.split()[2:]) for line in lines}
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    for name, weights_per_thread in (("down", 64), ("gate_up", 128)):  # a K tile: [128, 64] (x2 for gate/up) / 128
        after, before = ops[("after", name)], ops[("weights", name)]
        assert not any(op.startswith("cvt") and "e4m3" in op or op == "cvt.f32.f16" for op in after), after
        # a weight pair: one prmt, one packed multiply; fp32 multiplies only in the epilogue (router weight, SiLU)
        assert int(after["prmt.b32"]) == int(after["fma.rn.bf16x2"]) == weights_per_thread // 2
        assert int(after.get("mul.f32", 0)) < weights_per_thread // 4 and mma in after
        assert int(before["cvt.rn.f16x2.e4m3x2"]) == weights_per_thread // 2
        assert int(before["mul.f32"]) >= weights_per_thread


def fp8_experts(num_experts: int, hidden: int, inter: int, block, seed: int):
    """FP8 stacked experts as ``layers.fp8.Fp8Experts`` holds them (gate and up halves blocked apart) and their
    dequantized fp32 weights."""
    gate, gate_scale = fp8_weight(inter, hidden, block, seed, (num_experts,))
    up, up_scale = fp8_weight(inter, hidden, block, seed + 1, (num_experts,))
    down, down_scale = fp8_weight(hidden, inter, block, seed + 2, (num_experts,))
    gate_up, gate_up_scale = torch.cat([gate, up], dim=1), torch.cat([gate_scale, up_scale], dim=1)
    full = (torch.cat([dequantize_fp8(gate, gate_scale, block), dequantize_fp8(up, up_scale, block)], dim=1),
            dequantize_fp8(down, down_scale, block))
    return gate_up, down, (gate_up_scale, down_scale, block), full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 2, 9])
@pytest.mark.parametrize("hidden", [48, 40])
def test_fp8_fused_experts_match_the_dequantized_expert_loop(dtype, num_tokens, hidden):
    """Grouped GEMMs (the scales after each K tile's dot, and on the weights) and per-pair GEMVs; an intermediate
    size (24) that is not a multiple of the block (16), so the up half's scales start a block row of their own, and
    a hidden size of 2.5 blocks (40: the gate/up GEMM's last K tile masked)."""
    num_experts, inter, top_k, block = 6, 24, 2, (16, 16)
    gate_up, down, scales, (gate_up_full, down_full) = fp8_experts(num_experts, hidden, inter, block, seed=num_tokens)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE, dtype), top_k, True)
    want = moe.run_experts(x, gate_up_full.to(dtype), down_full.to(dtype), ids, weights)
    gemm = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # BLOCK_K cut to the block's 16
    on_weights = dict(gemm, SCALE_AFTER_DOT=False)
    for config in (dict(BLOCK_M=16, gate_up=gemm, down=gemm), dict(BLOCK_M=16, gate_up=on_weights, down=on_weights),
                   None):
        got = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, config, fp8_scales=scales)
        assert rel_error(got, want) < tolerance(dtype)
    by_pair = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=True, fp8_scales=scales)
    assert rel_error(by_pair, want) < tolerance(dtype)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_fp8_pair_gemvs_over_several_chunks(num_tokens, monkeypatch):
    """The per-pair GEMVs with K chunks shorter than K (the last one partial) and several scale blocks per chunk:
    gate/up over hidden 80 in chunks of 64 (two 32-wide groups), down over intermediate 48 in chunks of 32."""
    num_experts, hidden, inter, top_k, block = 5, 80, 48, 2, (32, 32)
    monkeypatch.setattr(fused_moe, "PAIR_GEMV_TUNED", {("gate_up", hidden, inter): (4, 64, 4),
                                                       ("down", inter, hidden): (8, 32, 4)})
    gate_up, down, scales, (gate_up_full, down_full) = fp8_experts(num_experts, hidden, inter, block, seed=3)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    weights, ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, True)
    want = moe.run_experts(x, gate_up_full, down_full, ids, weights)
    got = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=True, fp8_scales=scales)
    assert rel_error(got, want) < 1e-5


def e4m3_as_bf16_recipe(codes: torch.Tensor) -> torch.Tensor:
    """``fused_moe._E4M3_TO_BF16_ASM``'s steps in torch on e4m3 bytes (uint8): each byte in the low byte of a 16-bit
    half with its sign bit repeated over the high byte (prmt), shifted left 4, and 0x87f0, times 2^120 as bf16."""
    byte = codes.to(torch.int32)
    half = ((torch.where(byte >= 0x80, 0xFF00, 0) | byte) << 4) & 0x87F0
    return half.to(torch.int16).view(torch.bfloat16) * torch.tensor(2.0 ** 120, dtype=torch.bfloat16)


def test_e4m3_to_bf16_bit_recipe_is_exact_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    want = codes.view(FP8_DTYPE).to(torch.bfloat16)
    got = e4m3_as_bf16_recipe(codes)
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))  # -0 and subnormals too
    assert torch.equal(got[~finite], torch.tensor([480.0, -480.0], dtype=torch.bfloat16))


@cuda
def test_e4m3_to_bf16_asm_is_exact_for_every_finite_code():
    """The PTX itself (the GEMMs' tiles on the GPU in bf16): what the recipe above gives, bit for bit (a subnormal
    flushed by the packed multiply would show here)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = fused_moe.e4m3_as_bf16(codes.view(FP8_DTYPE).cuda()).cpu()
    assert torch.equal(got.view(torch.int16), e4m3_as_bf16_recipe(codes).view(torch.int16))


def test_fp8_experts_without_scales_are_refused():
    gate_up, down, scales, _ = fp8_experts(4, 32, 16, (16, 16), seed=0)
    x = torch.randn(1, 32).to(DEVICE)
    weights, ids = moe.route(torch.randn(1, 4).to(DEVICE), 2, True)
    with pytest.raises(ValueError, match="without FP8 block scales"):
        fused_moe.fused_experts(x, gate_up, down, ids.int(), weights)


def test_fp8_moe_block_kernel_path_matches_its_torch_path():
    """``SparseMoE.forward_with_kernels`` with FP8 experts (the talker's shared expert included) against
    ``forward``'s torch path, through the interpreter on the CPU."""
    from omni_triton.models.layers.fp8 import Fp8Experts, Fp8Linear, quantize_modules_
    from omni_triton.models.quantization import Fp8Scheme

    torch.manual_seed(0)
    block = moe.SparseMoE(32, 4, 2, 16, True, shared_expert_intermediate_size=32)
    quantize_modules_(block, Fp8Scheme((16, 16)), lambda name, module: name in (
        "experts", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"))
    assert isinstance(block.experts, Fp8Experts) and isinstance(block.shared_expert.up_proj, Fp8Linear)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if param.dtype == FP8_DTYPE:
                param.copy_((torch.randn(param.shape) * 100).clamp(-448, 448).to(FP8_DTYPE))
            elif name.endswith("_scale_inv"):
                param.copy_(torch.rand(param.shape) * 1e-3 + 1e-4)
            else:
                param.normal_(0, 0.2)
    block = block.to(DEVICE)
    x = torch.randn(3, 32).to(DEVICE)
    block.pack_projections_()
    assert block.packed_input_proj is None  # FP8 shared expert: its own launches
    with torch.no_grad():
        got = block.forward_with_kernels(x)
        for module in block.modules():  # the torch path on a GPU as well
            if hasattr(module, "use_kernels"):
                module.use_kernels = False
        want = block(x)
    assert rel_error(got, want) < 1e-5


@cuda
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("depth,cols", [(2048, 4096 + 2 * 512), (4096, 2048), (1024, 2048 + 2 * 256)])
def test_fp8_linear_full_size_bf16(rows, act_quant, depth, cols):
    """The thinker's qkv / o_proj and the talker's qkv widths, 128 x 128 blocks, bf16, eager and graphed."""
    block = (128, 128)
    weight, scale_inv = fp8_weight(cols, depth, block, seed=rows)
    x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, dequantize_fp8(weight, scale_inv, block, torch.bfloat16))
    got = fp8_linear(x, weight, scale_inv, block, act_quant=act_quant)
    assert rel_error(got, want) < (0.06 if act_quant else 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = fp8_linear(x, weight, scale_inv, block, act_quant=act_quant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, got)


@cuda
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("depth,cols", [(2048, 4096 + 2 * 512), (4096, 2048), (1024, 2048 + 2 * 256), (2048, 1024),
                                        (1024, 2 * 768), (1024, 2 * 1024 + 2 * 1024), (1024, 2 * 3072), (3072, 1024)])
def test_fp8_small_row_launches_full_size_bf16(rows, depth, cols):
    """A decode step's rows at the released shapes, 128 x 128 blocks, bf16: the thinker's packed qkv and o_proj,
    the talker's packed qkv, o_proj and shared-expert gate/up, the code predictor's packed qkv, gate/up and down;
    against the dequantized product and the one-pass launch, and replayed under a CUDA graph (the split launch's
    partials from the graph's pool, its tickets back at 0 between replays: the same bits every time)."""
    block = (128, 128)
    weight, scale_inv = fp8_weight(cols, depth, block, seed=rows)
    x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, dequantize_fp8(weight, scale_inv, block, torch.bfloat16))
    got = fp8_linear(x, weight, scale_inv, block)
    assert rel_error(got, want) < 1e-2
    assert rel_error(got, fp8_linear(x, weight, scale_inv, block, small_rows=False)) < 1e-2
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = fp8_linear(static, weight, scale_inv, block)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphed, got)
    static.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, fp8_linear(static, weight, scale_inv, block))


@cuda
@pytest.mark.parametrize("num_tokens", [1, 2, 64, 1024])
@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (128, 1024, 384, 6)])
def test_fp8_fused_experts_full_size_bf16(num_tokens, shape):
    """The thinker's and the talker's expert shapes, 128 x 128 blocks, bf16; per-pair GEMVs at 1-2 tokens."""
    num_experts, hidden, inter, top_k = shape
    gate_up, down, scales, (gate_up_full, down_full) = fp8_experts(num_experts, hidden, inter, (128, 128), seed=1)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe.route(torch.randn(num_tokens, num_experts, device="cuda", dtype=torch.bfloat16), top_k, True)
    want = moe.run_experts(x, gate_up_full.to(torch.bfloat16), down_full.to(torch.bfloat16), ids, weights)
    for gemv in (False, True):
        got = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=gemv, fp8_scales=scales)
        assert rel_error(got, want) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=True, fp8_scales=scales)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(graphed, want) < 1e-2


@cuda
def test_fp8_thinker_and_talker_kernels_match_their_torch_path(tmp_path):
    """The tiny FP8 model (random weights quantized at load, 128 x 128 blocks: partial blocks everywhere) on the GPU:
    a prefill of 24 tokens in bf16 through the kernels, w8a16 and w8a8, and through the same modules' torch path,
    each against the torch path in fp32 on the same FP8 weights. A whole random model in bf16 drifts by several
    percent from fp32 whichever path runs it, so the kernels are held to the torch path's own bf16 error: w8a16
    (the torch path's product) within 2x of it, w8a8 (activations rounded to e4m3 too) within 0.2."""
    from omni_triton.checkpoints.tiny import build
    from omni_triton.models.layers.attention import contiguous_batch
    from omni_triton.models.layers.fast_kernels import set_fast_kernels
    from omni_triton.models.layers.fp8 import set_fp8_activations
    from omni_triton.models.weights import load_talker, load_thinker

    checkpoint = build(tmp_path / "tiny", "tiny")
    loaders = (lambda dtype: load_thinker(checkpoint, "cuda", dtype, with_audio=False, quantization="fp8"),
               lambda dtype: load_talker(checkpoint, "cuda", dtype, quantization="fp8", fp8_everywhere=True))
    for load in loaders:
        def prefill(model, embeds, kernels, activations="bf16"):
            set_fast_kernels(model, kernels)
            set_fp8_activations(model, activations)
            batch = contiguous_batch([24], model.num_layers, model.num_kv_heads, model.head_dim,
                                     dtype=embeds.dtype, device="cuda")
            with torch.no_grad():
                return model.model(embeds, torch.arange(24, device="cuda")[None].expand(3, -1), batch)[0]

        reference_model, model = load(torch.float32), load(torch.bfloat16)
        embeds = torch.randn(24, model.hidden_size, device="cuda", dtype=torch.bfloat16)
        want = prefill(reference_model, embeds.float(), kernels=False)
        torch_error = rel_error(prefill(model, embeds, kernels=False), want)
        w8a16_error = rel_error(prefill(model, embeds, kernels=True), want)
        w8a8_error = rel_error(prefill(model, embeds, kernels=True, activations="fp8"), want)
        assert torch_error < 0.1
        assert w8a16_error < 2 * torch_error + 5e-3, (w8a16_error, torch_error)
        assert w8a8_error < 0.2, (w8a8_error, torch_error)


@cuda
@pytest.mark.parametrize("weights", ["quantized-at-load", "fp8-checkpoint"])
def test_fp8_thinker_engine_under_cuda_graphs_matches_its_torch_path(tmp_path, weights):
    """The engine's fast path (FP8 kernels inside the decode and prefill CUDA graphs) and its plain torch path
    give the tiny FP8 thinker's greedy tokens alike (fp32 activations: the two paths differ by rounding only).
    Quantized at load (128 x 128 blocks: q/k/v apart), and the FP8 checkpoint of 32 x 32 blocks (q/k/v packed,
    ``layers.fp8_packed``)."""
    from omni_triton.checkpoints.tiny import build
    from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, ThinkerStage
    from omni_triton.models.layers.fp8_packed import PackedFp8Linear
    from omni_triton.models.weights import load_thinker

    source = build(tmp_path / "tiny", "tiny")
    if weights == "fp8-checkpoint":
        pytest.importorskip("transformers")
        from build_engines.fp8_checkpoint import write_fp8_checkpoint

        model = load_thinker(write_fp8_checkpoint(source, tmp_path / "fp8", (32, 32)), "cuda", torch.float32,
                             with_audio=False)
    else:
        model = load_thinker(source, "cuda", torch.float32, with_audio=False, quantization="fp8")
    prompts = [list(range(3, 3 + n)) for n in (5, 37, 16)]
    runs = []
    for fast in (True, False):
        engine = LLMEngine(ThinkerStage(model), EngineConfig(
            block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
            kv_dtype=torch.float32, fast_path=fast, cuda_graphs=fast))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True),
                               prompt_token_ids=prompt)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs.append(tokens)
    assert runs[0] == runs[1] and all(len(t) == 32 for t in runs[0].values())
    packed = isinstance(model.model.layers[0].self_attn.packed_qkv, PackedFp8Linear)
    assert packed == (weights == "fp8-checkpoint")
