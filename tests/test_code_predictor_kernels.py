"""The code predictor's fused kernels (``kernels.small_linear``, ``kernels.frame_attention``) and its fused frame
(``CodePredictor.predict_with_kernels``) against the torch modules they replace.

CPU (Triton's interpreter, fp32/fp16, small shapes): each kernel flag against its torch composition, the frame
attention step by step against ``FrameCache``, and a whole frame: greedy codes identical, logits close.
GPU (skipped without CUDA): the same at the released dimensions (hidden 1024, 16/8 heads x 128, MLP 3072, 2048
codes, 5 layers, 16 code groups) in bf16 with seeded random weights, batches 1, 8, 64; the fused frame inside a
CUDA graph equals it eager (both with the linears' one-pass and split-K launches); the fused frame takes far
fewer launches than the module path.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import omni_triton.kernels.frame_attention as frame_attention_module  # noqa: E402
from omni_triton.kernels.activation import silu_and_mul  # noqa: E402
from omni_triton.kernels.frame_attention import frame_attention  # noqa: E402
from omni_triton.kernels.small_linear import small_linear  # noqa: E402
from omni_triton.models.code_predictor import CodePredictor, FrameCache  # noqa: E402
from omni_triton.models.config import TextModelConfig  # noqa: E402
from omni_triton.models.layers.fast_kernels import LINEAR_LAUNCHES, KernelSwitch  # noqa: E402
from omni_triton.models.layers.norm import RMSNorm  # noqa: E402
from omni_triton.models.layers.rope import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (full-size bf16 kernels)")
# The interpreter computes tl.dot of bf16 operands wrongly (see test_kernels.py): bf16 only on the GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

SMALL = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=None)
RELEASED = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_layers=5, num_heads=16,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=None)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


def random_predictor(dims: dict, dtype: torch.dtype, seed: int = 0, groups: int = 16) -> CodePredictor:
    """Weights drawn so activations stay O(1) through the layers (as trained ones do): N(0, 1/fan_in)
    matrices, norm weights near 1, embeddings N(0, 1)."""
    torch.manual_seed(seed)
    predictor = CodePredictor(TextModelConfig(**dims), groups)
    with torch.no_grad():
        for name, p in predictor.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embedding" in name:
                p.normal_()
            else:
                p.normal_(std=p.shape[1] ** -0.5)
    return predictor.to(DEVICE, dtype).eval()


# ---------------------------------------------------------------------------------------------- small_linear

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("variant", ["plain", "norm", "gated", "residual", "norm-fp32-out"])
def test_small_linear_equals_its_torch_composition(dtype, rows, variant):
    gen = torch.Generator().manual_seed(rows)
    depth, cols = 300, 48  # neither a multiple of the blocks (masks), and K in two steps
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(2 * cols if variant == "gated" else cols, depth, generator=gen) / depth ** 0.5).to(DEVICE, dtype)
    if variant in ("norm", "norm-fp32-out"):
        norm = RMSNorm(depth, 1e-6)
        norm.weight.data = 1 + 0.1 * torch.randn(depth, generator=gen)
        norm = norm.to(DEVICE, dtype)
        want = F.linear(norm(x), weight)
        out_dtype = torch.float32 if variant == "norm-fp32-out" else None
        got = small_linear(x, weight, norm_weight=norm.weight, eps=norm.eps, out_dtype=out_dtype)
        want = want.to(out_dtype or dtype)
    elif variant == "gated":
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = small_linear(x, weight, gated=True)
    elif variant == "residual":
        residual = torch.randn(rows, cols, generator=gen).to(DEVICE, dtype)
        want = residual + F.linear(x, weight)
        got = small_linear(x, weight, residual=residual)
    else:
        want = F.linear(x, weight)
        got = small_linear(x, weight)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_error(got, want) < tolerance(dtype)


def test_small_linear_reads_strided_rows_and_rejects_bad_shapes():
    x = torch.randn(3, 2, 32, device=DEVICE)
    weight = torch.randn(16, 32, device=DEVICE)
    torch.testing.assert_close(small_linear(x[:, -1], weight), F.linear(x[:, -1], weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="matching K"):
        small_linear(x[:, -1], torch.randn(16, 31, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        small_linear(x[:, -1], weight, residual=torch.zeros(3, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("split_k", [1, None])  # one pass, and the split plan (its last program's epilogue)
def test_small_linear_row_squares_feed_the_folded_activation(dtype, rows, split_k):
    """row_squares: the same output, plus each column block's sum of its squares; silu_and_mul with those as
    input_norm: silu(r * gate) * (r * up) with r = rsqrt(mean square + eps), each product rounded."""
    gen = torch.Generator().manual_seed(rows)
    hidden, inter, eps = 80, 150, 1e-6  # ragged against the blocks
    attended = torch.randn(rows, 96, generator=gen).to(DEVICE, dtype)
    o_weight = (torch.randn(hidden, 96, generator=gen) / 96 ** 0.5).to(DEVICE, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    x, squares = small_linear(attended, o_weight, residual=residual, row_squares=True, split_k=split_k)
    assert torch.equal(x, small_linear(attended, o_weight, residual=residual, split_k=split_k))
    assert squares.dtype == torch.float32 and squares.shape[1] == rows
    block = -(-hidden // squares.shape[0])  # the column blocks, in order
    for b in range(squares.shape[0]):
        want = (x[:, b * block:(b + 1) * block].float() ** 2).sum(dim=1)
        torch.testing.assert_close(squares[b], want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * inter, generator=gen).to(DEVICE, dtype)
    rstd = torch.rsqrt((x.float() ** 2).mean(dim=1, keepdim=True) + eps)
    gate, up = ((gate_up.float() * rstd).to(dtype)).chunk(2, dim=-1)
    got = silu_and_mul(gate_up, input_norm=(squares, hidden, eps))
    assert rel_error(got, F.silu(gate) * up) < tolerance(dtype)
    with pytest.raises(ValueError, match="float32"):
        silu_and_mul(gate_up, input_norm=(squares[:, :0], hidden, eps))


# ---------------------------------------------------------------------------------------------- frame attention

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [dict(heads=4, kv_heads=2, head_dim=16, rows=3),
                                  dict(heads=6, kv_heads=2, head_dim=32, rows=2)])  # group 3: a padded group
def test_frame_attention_equals_norm_rope_and_the_frame_cache(dtype, dims):
    gen = torch.Generator().manual_seed(dims["heads"])
    heads, kv_heads, head_dim, rows = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["rows"]
    positions = 8
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    q_norm, k_norm = q_norm.to(DEVICE, dtype), k_norm.to(DEVICE, dtype)
    cos, sin = RotaryEmbedding(head_dim, 1e6).cos_sin(torch.arange(positions, device=DEVICE), dtype)
    reference = FrameCache(1, rows, positions, kv_heads, head_dim, dtype, torch.device(DEVICE))
    keys = torch.zeros(rows, kv_heads, positions, head_dim, dtype=dtype, device=DEVICE)
    values = torch.zeros_like(keys)
    start, new = 0, 2
    while start + new <= positions:
        qkv = torch.randn(rows * new, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        where = torch.arange(start, start + new, device=DEVICE).repeat(rows)
        q = apply_rotary(q_norm(q.reshape(-1, heads, head_dim)), cos[where], sin[where])
        k = apply_rotary(k_norm(k.reshape(-1, kv_heads, head_dim)), cos[where], sin[where])
        want = reference.attend(0, q, k, v.reshape(-1, kv_heads, head_dim), scale=head_dim ** -0.5)
        reference.advance(new)
        got = frame_attention(qkv, q_norm.weight, k_norm.weight, cos, sin, keys, values, start, new, heads, 1e-6,
                              head_dim ** -0.5)
        assert rel_error(got, want.reshape(rows * new, -1)) < tolerance(dtype), (start, new)
        torch.testing.assert_close(keys[:, :, :start + new], reference.keys[0, :, :, :start + new],
                                   **_close(dtype))
        start, new = start + new, 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_frame_attention_applies_the_folded_input_norm(dtype):
    """input_norm=(x, eps): q, k and v scaled by their row's rsqrt(mean(x^2) + eps) and rounded first; the same
    as the plain kernel on the scaled qkv (both the 2-token first step and a 1-token step)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, rows, positions, hidden = 4, 2, 16, 3, 4, 40
    norm_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype)
    cos, sin = RotaryEmbedding(head_dim, 1e6).cos_sin(torch.arange(positions, device=DEVICE), dtype)
    caches = [torch.zeros(rows, kv_heads, positions, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    start = 0
    for new in (2, 1):
        x = (3 * torch.randn(rows * new, hidden, generator=gen)).to(DEVICE, dtype)
        qkv = torch.randn(rows * new, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
        rstd = torch.rsqrt((x.float() ** 2).mean(dim=1, keepdim=True) + 1e-6)
        args = (norm_weight, norm_weight, cos, sin)
        want = frame_attention((qkv.float() * rstd).to(dtype), *args, caches[0], caches[1], start, new, heads, 1e-6,
                               0.25)
        got = frame_attention(qkv, *args, caches[2], caches[3], start, new, heads, 1e-6, 0.25,
                              input_norm=(x, 1e-6))
        assert rel_error(got, want) < tolerance(dtype)
        for mine, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
            torch.testing.assert_close(mine, theirs, **_close(dtype))
        start += new
    with pytest.raises(ValueError, match="input_norm"):
        frame_attention(qkv, *args, caches[2], caches[3], start - 1, 1, heads, 1e-6, 0.25, input_norm=(x[:1], 1e-6))


def test_frame_attention_reads_qkv_rows_from_a_table():
    """qkv_rows: token t's q/k/v are the table's row qkv_rows[t]; the same as the plain kernel on the gathered
    rows (keys, values and output), with or without the folded input norm."""
    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, head_dim, rows, positions, hidden, entries = 4, 2, 16, 3, 4, 40, 11
    dtype = torch.float32
    norm_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype)
    cos, sin = RotaryEmbedding(head_dim, 1e6).cos_sin(torch.arange(positions, device=DEVICE), dtype)
    table = torch.randn(entries, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    args = (norm_weight, norm_weight, cos, sin)
    for input_norm in (None, (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype), 1e-6)):
        caches = [torch.randn(rows, kv_heads, positions, head_dim, generator=gen).to(DEVICE, dtype)
                  for _ in range(2)]
        caches += [cache.clone() for cache in caches]
        codes = torch.tensor([7, 0, 7], device=DEVICE)  # a repeated entry, and the first
        want = frame_attention(table[codes], *args, caches[0], caches[1], 2, 1, heads, 1e-6, 0.25,
                               input_norm=input_norm)
        got = frame_attention(table, *args, caches[2], caches[3], 2, 1, heads, 1e-6, 0.25, input_norm=input_norm,
                              qkv_rows=codes.to(torch.int32))
        torch.testing.assert_close(got, want, **_close(dtype))
        for mine, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
            torch.testing.assert_close(mine, theirs, **_close(dtype))
    with pytest.raises(ValueError, match="qkv_rows"):
        frame_attention(table, *args, caches[2], caches[3], 2, 1, heads, 1e-6, 0.25, qkv_rows=codes[:2])


def _close(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def test_frame_attention_rejects_a_cache_too_long_for_one_program():
    keys = torch.zeros(1, 2, 32, 16, device=DEVICE)
    qkv = torch.zeros(1, 8 * 16, device=DEVICE)
    cos = torch.zeros(32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        frame_attention(qkv, torch.ones(16), torch.ones(16), cos, cos, keys, keys.clone(), 0, 1, 4, 1e-6, 0.25)


# ---------------------------------------------------------------------------------------------- whole frame

def recorded_frame(predictor: CodePredictor, hidden, code0_embeds, fused: bool, forced: torch.Tensor | None = None,
                   dtypes: set | None = None):
    """(codes, embeds, logits per group) of one frame; ``forced`` [B, G-1] codes feed both paths the same
    inputs (teacher forcing), so their logits compare step by step even where greedy picks would differ.
    ``dtypes`` collects the dtypes of the logits the sampler was handed."""
    logits = []

    def sample_fn(step_logits, group):
        if dtypes is not None:
            dtypes.add(step_logits.dtype)
        logits.append(step_logits.float().clone())
        return step_logits.argmax(dim=-1) if forced is None else forced[:, group - 1]

    run = predictor.predict_with_kernels if fused else _module_path(predictor)
    codes, embeds = run(hidden, code0_embeds, sample_fn)
    return codes, torch.stack(embeds, dim=1), torch.stack(logits, dim=1)


def _module_path(predictor: CodePredictor):
    def run(*args):
        predictor.use_kernels = False
        try:
            return predictor.predict(*args)
        finally:
            predictor.use_kernels = True
    return run


def assert_greedy_agrees(predictor: CodePredictor, hidden, code0_embeds, logit_tolerance: float) -> None:
    """Greedy codes of the fused frame equal the module frame's; a row may differ only from a step where the
    module path's two best logits were within ``logit_tolerance`` (a near-tie that bf16 rounding may flip)."""
    want_codes, _, want_logits = recorded_frame(predictor, hidden, code0_embeds, fused=False)
    got_codes, _, _ = recorded_frame(predictor, hidden, code0_embeds, fused=True)
    top2 = want_logits.topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]  # [B, G-1]
    for row in range(want_codes.shape[0]):
        differs = (got_codes[row] != want_codes[row]).nonzero()
        if len(differs):
            first = int(differs[0])
            assert gaps[row, first] <= logit_tolerance, (
                f"row {row} group {first + 1}: fused code {int(got_codes[row, first])} != "
                f"{int(want_codes[row, first])} with a top-2 gap of {float(gaps[row, first]):.4f}")


def check_frame(dims: dict, dtype: torch.dtype, rows: int, logit_rel: float, seed: int = 0, groups: int = 16):
    """The fused frame against the module frame, teacher-forced and greedy; returns (predictor, hidden,
    code0_embeds, forced, the fused teacher-forced logits) for a caller's further checks on the same frame."""
    predictor = random_predictor(dims, dtype, seed, groups)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(rows, dims["hidden_size"], generator=gen).to(DEVICE, dtype)
    code0_embeds = torch.randn(rows, dims["hidden_size"], generator=gen).to(DEVICE, dtype)
    forced = torch.randint(0, dims["vocab_size"], (rows, predictor.num_code_groups - 1), generator=gen).to(DEVICE)
    want_codes, want_embeds, want_logits = recorded_frame(predictor, hidden, code0_embeds, False, forced)
    handed = set()
    got_codes, got_embeds, got_logits = recorded_frame(predictor, hidden, code0_embeds, True, forced, handed)
    assert torch.equal(got_codes, want_codes) and torch.equal(got_embeds, want_embeds)
    # the fused frame hands the sampler the model dtype's logits (the sampler reads them as fp32 itself)
    assert handed == {dtype}
    for group in range(got_logits.shape[1]):
        assert rel_error(got_logits[:, group], want_logits[:, group]) < logit_rel, group
    scale = float(want_logits.abs().max())
    assert_greedy_agrees(predictor, hidden, code0_embeds, logit_tolerance=4 * logit_rel * scale)
    return predictor, hidden, code0_embeds, forced, got_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_frame_equals_the_module_frame_small(dtype):
    # 8 code groups: every step kind (the 2-token first step, 1-token steps, the cache filling) in half the
    # interpreter time of 16
    check_frame(SMALL, dtype, rows=3, logit_rel=1e-5 if dtype == torch.float32 else 1e-2, groups=8)


def test_fused_frame_with_folded_pre_norms_equals_the_module_frame(monkeypatch):
    """The served launch's folded pre-norms (where its qkv and gate/up GEMMs take cuBLAS: forced here at the
    small dims) against the module frame in fp32 (bf16: the GPU tests below), and the folded weights made again
    when a norm weight changes."""
    dtype = torch.float32
    from omni_triton.kernels import small_linear as small_linear_module

    monkeypatch.setattr(small_linear_module, "takes_cublas", lambda rows, cols, residual: not residual)
    monkeypatch.setattr(KernelSwitch, "linear_launch", "gemv")
    folds = []
    real_fold = CodePredictor.folded_weights
    monkeypatch.setattr(CodePredictor, "folded_weights", lambda self: folds.append(1) or real_fold(self))
    check_frame(SMALL, dtype, rows=3, logit_rel=1e-5, groups=6)
    assert folds  # the folded path ran
    predictor = random_predictor(SMALL, dtype, groups=3)
    hidden = torch.randn(2, SMALL["hidden_size"], device=DEVICE, dtype=dtype)
    predictor.predict_with_kernels(hidden, hidden)
    first = [w.clone() for pair in predictor.folded_weights() for w in pair]
    with torch.no_grad():
        predictor.model.layers[0].input_layernorm.weight.mul_(2)
    again = [w for pair in predictor.folded_weights() for w in pair]
    assert not torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.parametrize("fold", [False, True])
def test_qkv_tables_replace_the_first_layers_qkv_after_the_first_step(monkeypatch, fold):
    """The steps after a frame's first read the first layer's q/k/v of the fed code from the tables: the frame
    equals the module frame with them (fp32; bf16 on the GPU below) and equals the fused frame without them;
    the tables are made once and again when an embedding changes."""
    dtype = torch.float32
    if fold:
        from omni_triton.kernels import small_linear as small_linear_module

        monkeypatch.setattr(small_linear_module, "takes_cublas", lambda rows, cols, residual: not residual)
        monkeypatch.setattr(KernelSwitch, "linear_launch", "gemv")
    gathered = []
    real_attention = frame_attention_module.frame_attention
    monkeypatch.setattr(frame_attention_module, "frame_attention",
                        lambda *a, **k: gathered.append(k.get("qkv_rows") is not None) or real_attention(*a, **k))
    groups, rows = 5, 3
    # its teacher-forced fused frame (with the tables) is the one compared with the frame without them below
    predictor, hidden, code0, forced, with_tables = check_frame(SMALL, dtype, rows=rows, logit_rel=1e-5,
                                                                groups=groups)
    steps = groups - 1
    # two frames (teacher-forced, greedy), each: the first layer of every step but the first from a table
    assert gathered.count(True) == 2 * (steps - 1) and len(gathered) == 2 * steps * SMALL["num_layers"]
    monkeypatch.setattr(CodePredictor, "qkv_tables", False)
    without = recorded_frame(predictor, hidden, code0, True, forced)
    torch.testing.assert_close(with_tables, without[2], rtol=1e-5, atol=1e-5)
    tables = [t.clone() for t in predictor.first_layer_qkv_tables()]
    assert len(tables) == groups - 2 and tables[0].shape == (SMALL["vocab_size"], predictor.model.layers[0]
                                                            .self_attn.packed_qkv[0].shape[0])
    assert predictor.first_layer_qkv_tables()[0] is predictor.first_layer_qkv_tables()[0]  # made once
    with torch.no_grad():
        predictor.model.codec_embedding[1].weight.mul_(2)
    again = predictor.first_layer_qkv_tables()
    assert torch.equal(again[0], tables[0]) and not torch.equal(again[1], tables[1])


def test_fast_path_switch_selects_the_fused_frame_only_on_cuda_tensors(monkeypatch):
    predictor = random_predictor(SMALL, torch.float32)
    calls = []
    monkeypatch.setattr(predictor, "predict_with_kernels", lambda *a: calls.append(a) or ("fused", []))
    hidden = torch.zeros(1, SMALL["hidden_size"], device=DEVICE)
    result = predictor.predict(hidden, hidden)
    assert isinstance(result[0], str) == (DEVICE == "cuda") and len(calls) == (DEVICE == "cuda")
    predictor.use_fused_steps = False  # the per-layer kernels only: the module path
    assert isinstance(predictor.predict(hidden, hidden)[0], torch.Tensor)
    predictor.use_fused_steps, predictor.use_kernels = True, False
    assert isinstance(predictor.predict(hidden, hidden)[0], torch.Tensor) and len(calls) == (DEVICE == "cuda")


@pytest.fixture(params=LINEAR_LAUNCHES)
def linear_launch(request, monkeypatch):
    """The fused frame's linears in each launch (``KernelSwitch.linear_launch``: one-pass, split-K, GEMV)."""
    monkeypatch.setattr(KernelSwitch, "linear_launch", request.param)
    return request.param


@cuda
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fused_frame_equals_the_module_frame_at_released_dims(rows, linear_launch):
    check_frame(RELEASED, torch.bfloat16, rows=rows, logit_rel=3e-2, seed=rows)


@cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_fused_frame_kernels_at_released_dims_in_bf16(rows):
    """The two kernels alone at full size in bf16 (what the interpreter cannot check)."""
    gen = torch.Generator().manual_seed(rows)
    for depth, cols, kwargs in ((1024, 4096, "norm"), (2048, 1024, "residual"), (1024, 3072, "gated"),
                                (3072, 1024, "residual"), (1024, 2048, "norm")):
        x = torch.randn(rows, depth, generator=gen).to(DEVICE, torch.bfloat16)
        weight = (torch.randn(cols * (2 if kwargs == "gated" else 1), depth, generator=gen)
                  / depth ** 0.5).to(DEVICE, torch.bfloat16)
        if kwargs == "norm":
            norm = torch.ones(depth, device=DEVICE, dtype=torch.bfloat16)
            want = F.linear(RMSNorm(depth).to(DEVICE, torch.bfloat16)(x), weight)
            got = small_linear(x, weight, norm_weight=norm, eps=1e-6)
        elif kwargs == "gated":
            gate, up = F.linear(x, weight).chunk(2, dim=-1)
            want, got = F.silu(gate) * up, small_linear(x, weight, gated=True)
        else:
            residual = torch.randn(rows, cols, generator=gen).to(DEVICE, torch.bfloat16)
            want, got = residual + F.linear(x, weight), small_linear(x, weight, residual=residual)
        assert rel_error(got, want) < 1e-2, (depth, cols, kwargs)


@cuda
def test_fused_frame_replays_under_a_cuda_graph(linear_launch):
    """Captured once, replayed on new inputs: the same codes and embeddings as the eager fused frame on them."""
    predictor = random_predictor(RELEASED, torch.bfloat16, seed=3)
    rows = 8
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, rows, 1024, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2)]
    static_hidden, static_code0 = inputs[0][0].clone(), inputs[0][1].clone()
    predictor.predict(static_hidden, static_code0)  # compiled, packed and the rotary table made before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # no garbage collection inside the capture (freeing an earlier test's engine there invalidates it: issue 20;
    # main's graph_buckets.capturing does the same for the engine's graphs)
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            graph_codes, graph_embeds = predictor.predict(static_hidden, static_code0)
    finally:
        gc.enable()
    for hidden, code0_embeds in inputs:
        static_hidden.copy_(hidden)
        static_code0.copy_(code0_embeds)
        graph.replay()
        eager_codes, eager_embeds = predictor.predict(hidden, code0_embeds)
        assert torch.equal(graph_codes, eager_codes)
        assert torch.equal(torch.stack(graph_embeds, 1), torch.stack(eager_embeds, 1))


@cuda
def test_fused_frame_launches_far_fewer_kernels():
    from torch.profiler import ProfilerActivity, profile

    predictor = random_predictor(RELEASED, torch.bfloat16, seed=4)
    hidden = torch.randn(4, 1024, device=DEVICE, dtype=torch.bfloat16)

    def launches(fused: bool) -> int:
        predictor.use_kernels = fused
        predictor.predict(hidden, hidden)  # compiled and packed before counting
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            predictor.predict(hidden, hidden)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    module, fused = launches(False), launches(True)
    predictor.use_kernels = True
    steps = predictor.num_code_groups - 1
    assert fused <= 30 * steps, fused  # per step: 5 layers x 5 + lm_head + argmax + embedding (+ 2 stacks)
    assert fused * 2 < module, (fused, module)


@cuda
@pytest.mark.parametrize("rows", [8, 64])
def test_folded_frame_is_as_close_to_fp32_as_the_bf16_modules(rows, monkeypatch):
    """The folded pre-norms round differently from the modules (the product of the folded weight, then the row
    scale); in bf16 at the released dims, teacher-forced, their logits are as close to the fp32 frame of the same
    weights as the bf16 module frame's and the unfolded fused frame's are."""
    import copy

    predictor = random_predictor(RELEASED, torch.bfloat16, seed=rows)
    reference = copy.deepcopy(predictor).float()
    gen = torch.Generator().manual_seed(rows)
    hidden, code0_embeds = (torch.randn(2, rows, RELEASED["hidden_size"], generator=gen) / 2).to(DEVICE, torch.bfloat16)
    forced = torch.randint(0, RELEASED["vocab_size"], (rows, predictor.num_code_groups - 1), generator=gen).to(DEVICE)
    exact = recorded_frame(reference, hidden.float(), code0_embeds.float(), False, forced)[2]
    errors = {"module": rel_error(recorded_frame(predictor, hidden, code0_embeds, False, forced)[2], exact)}
    monkeypatch.setattr(KernelSwitch, "linear_launch", "gemv")
    for fold in (False, True):
        monkeypatch.setattr(CodePredictor, "fold_norms", fold)
        errors["folded" if fold else "unfolded"] = rel_error(
            recorded_frame(predictor, hidden, code0_embeds, True, forced)[2], exact)
    print(f"rows {rows}: logits' relative error against fp32: {errors}")
    assert errors["folded"] <= 1.25 * max(errors["module"], errors["unfolded"]), errors
