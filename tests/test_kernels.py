"""Triton kernels of the GPU fast path against their torch references, on small shapes.

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before any test
module is collected); with one, on the GPU. The interpreter computes ``tl.dot`` of bf16 operands wrongly (triton 3.9),
and rounds to bf16 by truncation, so kernels are checked in fp32 and fp16 here and in bf16 on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from omni_triton.engine.sampling import race_sample  # noqa: E402
from omni_triton.kernels import activation, fused_moe, norm, paged_attention, random, routing, sampling  # noqa: E402
from omni_triton.kernels.scratch import buffers_of  # noqa: E402
from omni_triton.models.layers import moe  # noqa: E402
from omni_triton.models.layers.fast_kernels import pack_linears_  # noqa: E402
from omni_triton.models.layers.attention import AttentionBatch, _AttentionPlan, attend_fast, attend_paged  # noqa: E402
from omni_triton.models.layers.norm import RMSNorm  # noqa: E402
from omni_triton.models.layers.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from test_small_linear_gemv import RecordingKernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_the_module(dtype):
    gen = torch.Generator().manual_seed(0)
    module = RMSNorm(96, 1e-6)
    module.weight.data = 1 + 0.1 * torch.randn(96, generator=gen)
    module = module.to(DEVICE, dtype)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    # rsqrt may differ in its last ulp between torch and Triton, which can move a rounding by one ulp
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norm.rms_norm(x, module.weight, module.eps), module(x), **tolerance)
    normed, summed = norm.add_rms_norm(x, residual, module.weight, module.eps)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, module(x + residual), **tolerance)


@pytest.mark.parametrize("mrope", [None, (2, 3, 3)])
def test_head_norm_rope_matches_norm_then_rotary(mrope):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, head_dim = 6, 3, 16
    module = RMSNorm(head_dim, 1e-6)
    module.weight.data = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    module = module.to(DEVICE)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE)
    positions = torch.randint(0, 50, (3, tokens), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, mrope).cos_sin(positions, torch.float32)
    want = apply_rotary(module(x), cos, sin)
    torch.testing.assert_close(norm.head_norm_rope(x, module.weight, cos, sin, 1e-6), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_is_head_norm_rope_of_both_in_one_launch(dtype):
    """Queries and keys as column views of one packed qkv output (as the attention hands them), each with its
    own norm weight and eps: the same bits as two head_norm_rope calls."""
    gen = torch.Generator().manual_seed(2)
    tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, head_dim, generator=gen)).to(DEVICE, dtype)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None).cos_sin(positions, dtype)
    got_q, got_k = norm.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6, 1e-5)
    assert torch.equal(got_q, norm.head_norm_rope(q, q_weight, cos, sin, 1e-6))
    assert torch.equal(got_k, norm.head_norm_rope(k, k_weight, cos, sin, 1e-5))
    assert not torch.equal(got_k, norm.head_norm_rope(k, q_weight, cos, sin, 1e-5))  # its own weight, not q's


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_keys_and_values_as_store_kv_does(dtype):
    """``store=``: the keys go into their cache slots (and the values beside them) with the same bits as
    qk_norm_rope + store_kv; a padding row's slot (-1) stores nothing; q is unchanged and no k comes back."""
    gen = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, head_dim, blocks, block_size = 4, 4, 2, 16, 3, 4
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, head_dim, generator=gen)).to(DEVICE, dtype)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None).cos_sin(torch.arange(tokens).to(DEVICE), dtype)
    slots = torch.tensor([5, 0, -1, 11], device=DEVICE)
    poison = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    want_cache = poison.clone()
    want_q, want_k = norm.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6, 1e-5)
    paged_attention.store_kv(want_k, v, want_cache, slots)
    cache = poison.clone()
    got_q, got_k = norm.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6, 1e-5, store=(v, cache, slots))
    assert got_k is None and torch.equal(got_q, want_q)
    assert torch.equal(cache, want_cache)
    assert not torch.equal(cache, poison)  # something was stored, and only the slots given (the rest as before)
    with pytest.raises(ValueError, match="store"):
        norm.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 1e-6, 1e-5, store=(v, cache, slots[:2]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(activation.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_packed_linears_are_views_of_one_weight_and_compute_the_same():
    torch.manual_seed(6)
    linears = [torch.nn.Linear(8, n, bias=True) for n in (4, 2, 2)]
    x = torch.randn(3, 8)
    before = [linear(x) for linear in linears]
    weight, bias = pack_linears_(linears)
    assert weight.shape == (8, 8) and all(linear.weight.data_ptr() == weight[row:].data_ptr()
                                          for linear, row in zip(linears, (0, 4, 6)))
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, bias), torch.cat(before, dim=-1))
    assert all(torch.equal(linear(x), want) for linear, want in zip(linears, before))


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    return logits, moe.route(logits, top_k, normalize=True)


def test_router_kernel_matches_softmax_topk():
    logits, (want_weights, want_ids) = random_routing(9, 16, 4, seed=2)
    weights, ids = routing.route(logits, 4, normalize=True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sorted_layout", [True, False], ids=["sorted", "atomic"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m",
                         [(1, 8, 2, 16), (7, 8, 2, 4), (33, 8, 2, 16), (64, 128, 8, 16), (40, 16, 4, 64)])
def test_expert_sorted_layout_covers_every_pair_once(num_tokens, num_experts, top_k, block_m, sorted_layout):
    _, (_, ids) = random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    sorted_pairs, block_expert = routing.expert_sorted_layout(ids.int(), num_experts, block_m, sorted_layout)
    num_pairs = ids.numel()
    flat_ids = ids.reshape(-1).cpu()
    pairs = sorted_pairs.view(-1, block_m).cpu()
    owners = block_expert.cpu()
    valid = pairs < num_pairs
    assert sorted(pairs[valid].tolist()) == list(range(num_pairs))
    for block, owner in enumerate(owners.tolist()):
        if owner < 0:
            assert not valid[block].any()
        else:
            assert (flat_ids[pairs[block][valid[block]]] == owner).all()
    used = owners >= 0
    assert used.sum() == sum(-(-int((flat_ids == e).sum()) // block_m) for e in range(num_experts))
    assert not used[int(used.sum()):].any()  # runs are packed at the front
    assert owners[used].tolist() == sorted(owners[used].tolist())  # expert by expert


def test_sorted_layout_takes_over_up_to_its_pair_limit(monkeypatch):
    """Past SORT_MAX_PAIRS the atomic kernel runs (a prefill's thousands of pairs do not fit one sort); both
    kernels give the same block owners and put each pair in its expert's blocks (the order inside a run, so
    which of an expert's blocks holds a pair, is up to the atomics' order on a GPU)."""
    _, (_, ids) = random_routing(20, 16, 4, seed=5)
    monkeypatch.setattr(routing, "SORT_MAX_PAIRS", 79)  # 80 pairs: one past the limit
    by_sort, by_atomics = [], []
    monkeypatch.setattr(routing, "_sorted_layout_kernel", RecordingKernel(routing._sorted_layout_kernel, by_sort))
    monkeypatch.setattr(routing, "_expert_sorted_layout_kernel",
                        RecordingKernel(routing._expert_sorted_layout_kernel, by_atomics))
    layouts = [routing.expert_sorted_layout(ids.int(), 16, 8, sorted_layout) for sorted_layout in (True, False)]
    assert len(by_atomics) == 2 and not by_sort
    monkeypatch.setattr(routing, "SORT_MAX_PAIRS", 80)
    layouts.append(routing.expert_sorted_layout(ids.int(), 16, 8))
    assert len(by_sort) == 1 and len(by_atomics) == 2
    def pair_owners(pairs, owners):  # pair -> the expert whose block holds it
        return {pair: owner for block, owner in zip(pairs.view(-1, 8).tolist(), owners.tolist())
                for pair in block if pair < ids.numel()}

    want = pair_owners(*layouts[0])
    assert want == dict(enumerate(ids.reshape(-1).tolist()))
    for pairs, owners in layouts[1:]:
        assert torch.equal(owners, layouts[0][1]) and pair_owners(pairs, owners) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_experts_match_the_expert_loop(dtype, num_tokens):
    gen = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, top_k = 8, 32, 48, 2
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE, dtype)
    weights, ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE, dtype), top_k, True)
    want = moe.run_experts(x, gate_up, down, ids, weights)
    gemm = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
    for config in (dict(BLOCK_M=16, gate_up=gemm, down=gemm), None):
        got = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, config)
        assert rel_error(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    # gemv: per-pair GEMVs up to GEMV_MAX_TOKENS tokens, the grouped GEMMs above (the same result either way)
    by_pair = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, gemv=True)
    assert rel_error(by_pair, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_per_pair_gemv_experts_skip_the_layout_and_keep_the_shared_combine(num_tokens, monkeypatch):
    """At decode sizes ``gemv=True`` runs the per-pair kernels (no expert-sorted layout), ragged columns and K
    included, and the talker's shared combine rides on the top-k sum as on the grouped path."""
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter, top_k = 6, 40, 24, 3
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE)
    weights, ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, True)
    shared = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    shared_gate = torch.randn(num_tokens, 1, generator=gen).to(DEVICE)
    want = moe.run_experts(x, gate_up, down, ids, weights) + torch.sigmoid(shared_gate) * shared
    layouts = []
    monkeypatch.setattr(fused_moe, "expert_sorted_layout",
                        lambda *args: layouts.append(args) or routing.expert_sorted_layout(*args))
    got = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, shared=shared, shared_gate=shared_gate,
                                  gemv=True)
    assert rel_error(got, want) < 1e-6 and not layouts
    grouped = fused_moe.fused_experts(x, gate_up, down, ids.int(), weights, shared=shared, shared_gate=shared_gate)
    assert rel_error(grouped, got) < 1e-6 and len(layouts) == 1


def paged_batch(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    """A decode batch (one new token per sequence) over a cache with shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for i, n in enumerate(context_lens)]
    return AttentionBatch([1] * len(context_lens), context_lens, torch.tensor(slots).to(DEVICE), tables.to(DEVICE),
                          [cache], block_size)


def test_store_kv_writes_each_token_at_its_slot_and_skips_padding():
    batch = paged_batch([5, 17, 3], num_kv_heads=2, head_dim=16, block_size=4, seed=4)
    cache = batch.kv_caches[0]
    before = cache.clone()
    k, v = torch.randn(2, 4, 2, 16).to(DEVICE).unbind(0)
    slots = torch.cat((batch.slot_mapping, torch.tensor([-1], device=DEVICE)))
    paged_attention.store_kv(k, v, cache, slots)
    flat = before.view(2, -1, 2, 16)
    flat[0, batch.slot_mapping] = k[:3]
    flat[1, batch.slot_mapping] = v[:3]
    assert torch.equal(cache, before)


# The interpreter runs the grid's programs one after another (sequences x KV heads x splits), so the cases are
# the fewest programs that still take each path: groups of 2, 1 (with 3 KV heads: not a power of 2) and 8, each
# split 16 ways; 48 sequences x 4 KV heads take no context split (decode_splits: 4 x 132 // 192 = 2, one split;
# 44 x 4 would still split in 2), as the 80 x 4 (320 programs) did.
@pytest.mark.parametrize("num_heads,num_kv_heads,context_lens", [
    (4, 2, [1, 9, 70, 33]), (3, 3, [1, 9, 70, 33]), (8, 1, [1, 9, 70, 33]),
    (4, 4, [3, 130, 17, 64] * 12)])  # 48 sequences x 4 KV heads: no context split
def test_paged_decode_attention_matches_the_gather_reference(num_heads, num_kv_heads, context_lens):
    assert (paged_attention.decode_splits(len(context_lens), num_kv_heads) == 1) == (len(context_lens) == 48)
    batch = paged_batch(context_lens, num_kv_heads, head_dim=16, block_size=4, seed=num_heads)
    q = torch.randn(len(context_lens), num_heads, 16).to(DEVICE)
    want = attend_paged(q, batch.kv_caches[0], batch, scale=0.3)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention.paged_decode_attention(q, batch.kv_caches[0], batch.block_tables, lens, 0.3)
    assert rel_error(got, want) < 1e-5
    # the split that arrives last merged the others in split order and put its ticket back: a repeat call gives
    # the same bits
    assert all(not bool(t.any()) for t in buffers_of("paged_decode"))
    assert torch.equal(paged_attention.paged_decode_attention(q, batch.kv_caches[0], batch.block_tables, lens, 0.3),
                       got)


def test_paged_decode_attention_gives_zeros_for_padding_rows():
    batch = paged_batch([6, 2], num_kv_heads=2, head_dim=16, block_size=4, seed=9)
    q = torch.randn(2, 4, 16).to(DEVICE)
    out = paged_attention.paged_decode_attention(q, batch.kv_caches[0], batch.block_tables,
                                                 torch.tensor([6, 0], dtype=torch.int32, device=DEVICE))
    assert torch.isfinite(out).all() and not out[1].any() and out[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_in_attend_fast_matches_the_gather_reference(dtype):
    """A step mixing fresh prompts (one longer than a query tile), a chunk after cached context and a decode
    row: on the kernel path (all rows in one launch) every row equals the per-sequence gather + SDPA reference."""
    query_lens, context_lens = [5, 70, 1, 67], [5, 90, 12, 67]
    batch = paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, seed=11)
    batch.query_lens = query_lens
    cache = batch.kv_caches[0].to(dtype)
    batch.kv_caches = [cache]
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(sum(query_lens), 4, 16, generator=gen).to(DEVICE, dtype)
    # the new tokens' K/V (what attend_fast's SDPA path would read) are the cache's own rows at their slots
    block_size, new_kv = 4, []
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        for p in range(ctx_len - q_len, ctx_len):
            block = int(batch.block_tables[i, p // block_size])
            new_kv.append(cache[:, block, p % block_size])
    k, v = torch.stack(new_kv, dim=1)
    want = attend_paged(q, cache, batch, scale=0.3)
    plan = _AttentionPlan.build(batch)
    assert len(plan.kernel_seqs) == 4 and plan.decode_rows is not None
    got = attend_fast(q, k, v, cache, plan, 0.3, use_kernels=True)
    assert rel_error(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)
    torch.testing.assert_close(attend_fast(q, k, v, cache, _AttentionPlan.build(batch), 0.3), want,
                               **(dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.skipif(DEVICE != "cuda", reason="full-size bf16 prefill attention needs a CUDA GPU")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 4), (16, 2)])  # thinker, talker
def test_prefill_kernel_at_full_dims_in_bf16(num_heads, num_kv_heads):
    """108- and 512-token prompts, a 300-token chunk after 700 cached tokens, block size 16, head_dim 128."""
    query_lens, context_lens = [108, 512, 300], [108, 512, 1000]
    batch = paged_batch(context_lens, num_kv_heads=num_kv_heads, head_dim=128, block_size=16, seed=num_heads)
    batch.query_lens = query_lens
    cache = batch.kv_caches[0].to(torch.bfloat16)
    batch.kv_caches = [cache]
    plan = _AttentionPlan.build(batch)
    q = torch.randn(sum(query_lens), num_heads, 128, device=DEVICE, dtype=torch.bfloat16)
    from omni_triton.kernels.paged_attention import paged_prefill_attention, prefill_tiles

    got = paged_prefill_attention(q, cache, batch.block_tables, *prefill_tiles(plan.kernel_seqs, q.device), 128 ** -0.5)
    want = attend_paged(q, cache, batch, scale=128 ** -0.5)
    assert rel_error(got, want) < 1e-2


def test_the_interpreters_listed_scan_patches_what_its_full_scan_does():
    """conftest.py swaps the interpreter's builtin scan for one over names listed once (tests/_interpreter_scan.py):
    on every package it scans, both wrap the same names, so the kernels here run as under the stock interpreter."""
    from triton.runtime import interpreter

    listed = interpreter._patch_builtin
    if getattr(listed, "original", None) is None:
        pytest.skip("the stock scan is in use (no interpreter, or this Triton has no _patch_builtin to swap)")
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        patched = []
        for scan in (listed.original, listed):
            scope = interpreter._LangPatchScope()
            scan(pkg, interpreter.interpreter_builder, scope)
            patched.append(sorted(name for _, name, _ in scope._changes))
            scope.restore()
        assert patched[0] == patched[1] and (patched[0] or pkg is tl.math), pkg


def test_uniform_rows_depend_only_on_the_row_seed():
    seeds = torch.tensor([7, 123456789012345, 7], device=DEVICE)
    draws = random.uniform_rows(seeds, 3000)
    assert ((draws >= 0) & (draws < 1)).all()
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
    assert torch.equal(random.uniform_rows(seeds[1:2], 3000)[0], draws[1])
    assert abs(float(draws.mean()) - 0.5) < 0.02


def test_fused_row_sampler_draws_what_the_torch_race_draws():
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 12, 100
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEVICE)
    logits[3, 7] = float("-inf")  # banned ids stay out
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * 3, device=DEVICE)
    top_k = torch.tensor([0, 0, 5, 50, 1, 3] * 2, device=DEVICE)
    top_p = torch.tensor([1.0, 0.8, 0.5, 1.0, 0.95, 0.3] * 2, device=DEVICE)
    seeds = torch.randint(0, 1 << 60, (rows,), generator=gen).to(DEVICE)
    for group in (0, 3):
        got = sampling.sample_rows(logits, temperature, top_k, top_p, seeds, group)
        want = race_sample(logits, temperature, top_k, top_p, seeds + group)
        assert torch.equal(got, want)
    assert int(got[0]) == int(logits[0].argmax())


def test_penalize_is_the_torch_repetition_penalty_and_bans_in_one_launch():
    """Across block edges (a vocabulary of 2.5 blocks), both signs, every ban code, and the stop-id ban on and
    off: bit for bit what DeviceSampler's torch formulation gave (IEEE division: no approximate reciprocal)."""
    gen = torch.Generator().manual_seed(12)
    rows, slots, vocab = 4, 6, 5000
    logits = (torch.randn(rows, vocab, generator=gen) * 5).to(DEVICE)
    seen = (torch.rand(slots, vocab, generator=gen) < 0.2).to(DEVICE)
    banned = torch.randint(0, 3, (slots, vocab), generator=gen).to(torch.int8).to(DEVICE)
    banned[torch.rand(slots, vocab, generator=gen) < 0.9] = 0
    penalty = torch.tensor([1.3, 1.0, 0.7, 2.9], device=DEVICE)
    row_slots = torch.tensor([5, 0, 3, 5], device=DEVICE)
    stop_banned = torch.tensor([1, 0, 1, 0], device=DEVICE)
    got = sampling.penalize(logits, penalty, row_slots, stop_banned, seen, banned, always=1, under_min=2)
    penalised = torch.where(logits < 0, logits * penalty[:, None], logits / penalty[:, None])
    want = torch.where(seen[row_slots], penalised, logits)
    bans = (banned[row_slots] == 1) | ((banned[row_slots] == 2) & (stop_banned[:, None] > 0))
    want = want.masked_fill(bans, float("-inf"))
    assert torch.equal(got, want)
    assert bool(torch.isinf(got[0]).any()) and not torch.equal(got[0], got[3])  # the same slot, other controls


def test_sampling_among_the_top_candidates_draws_what_the_torch_race_draws():
    """A vocabulary past the row kernel's: topk, the row kernel over the candidates, ids mapped back; the
    torch race with the same max_top_k draws the same ids (greedy rows: the row's argmax)."""
    gen = torch.Generator().manual_seed(13)
    rows, vocab = 8, 6000
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
    logits[2, :4000] = float("-inf")
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 0.6, 1.0, 0.0], device=DEVICE)
    top_k = torch.tensor([0, 20, 5, 20, 1, 13, 20, 20], device=DEVICE)
    top_p = torch.tensor([1.0, 0.8, 0.5, 1.0, 0.95, 0.3, 0.99, 0.8], device=DEVICE)
    seeds = torch.randint(0, 1 << 60, (rows,), generator=gen).to(DEVICE)
    for group in (0, 2):
        got = sampling.sample_candidates(logits, 20, temperature, top_k, top_p, seeds, group)
        want = race_sample(logits, temperature, top_k, top_p, seeds + group, max_top_k=20)
        assert torch.equal(got, want), (group, got, want)
    assert int(got[0]) == int(logits[0].argmax()) and int(got[7]) == int(logits[7].argmax())
    assert len(set(got[1:7].tolist())) > 3
    with pytest.raises(ValueError, match="candidates"):
        sampling.sample_candidates(logits, 0, temperature, top_k, top_p, seeds)


@triton.jit
def _threshold_probe_kernel(values_ptr, k_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr, SHORT: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.arange(0, BLOCK_V)
    values = tl.load(values_ptr + row * vocab + ids, mask=ids < vocab, other=float("-inf"))
    threshold, count, rounds = sampling._shortlist_threshold(sampling._ordered(values), tl.load(k_ptr + row), SHORT)
    tl.store(out_ptr + row * 3 + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, threshold,
             tl.where(tl.arange(0, 4) == 1, count, rounds)).to(tl.int64), mask=tl.arange(0, 4) < 3)


def test_shortlist_threshold_halves_the_values_not_their_bits():
    """The shortlist's bisection: a threshold that k to SHORTLIST values reach, found in a handful of counts
    on rows like logits (halving the bit patterns took 8-10 here: the exponents between the k-th value and 0);
    rows with -inf (banned) ids and rows with fewer finite values than k keep the invariant."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 6, 2048
    values = torch.randn(rows, vocab, generator=gen) * 3 - 4
    values -= values.max(dim=1, keepdim=True).values  # as the kernel sees them: the row's max at 0
    values[1, ::3] = float("-inf")
    values[2, 40:] = float("-inf")  # 40 finite values, k 50: the bracket starts at -inf, the k-th is a tie
    values[3] = torch.randint(-8, 1, (vocab,), generator=gen).float()  # ties: no threshold under SHORTLIST
    k = torch.tensor([50, 50, 50, 50, 1, 64], dtype=torch.int32)
    out = torch.empty(rows, 3, dtype=torch.int64, device=DEVICE)
    _threshold_probe_kernel[(rows,)](values.to(DEVICE), k.to(DEVICE), out, vocab, BLOCK_V=vocab,
                                     SHORT=sampling.SHORTLIST)
    out = out.cpu()
    ordered = torch.where(values.view(torch.int32) >= 0, values.view(torch.int32), values.view(torch.int32) ^ 0x7FFFFFFF)
    for row in range(rows):
        threshold, count, rounds = out[row].tolist()
        assert count == int((ordered[row].long() >= threshold).sum()), row
        if row in (2, 3):  # ties at the k-th value (-inf in row 2): the caller sorts the row instead
            assert count > sampling.SHORTLIST, (row, count)
            continue
        assert int(k[row]) <= count <= sampling.SHORTLIST, (row, count)
        assert rounds <= 8, (row, rounds)


@pytest.mark.parametrize("vocab", [20, 300] + ([2048, 3072] if DEVICE == "cuda" else []))  # the interpreter: small
def test_fused_row_sampler_ranking_a_shortlist_draws_what_the_full_sort_draws(vocab):
    """Rows with 0 < top_k <= FAST_TOP_K rank a shortlist instead of sorting the row: the same draws as the torch
    race's full sort, with ties in value (cut by lower id first), banned ids (row 2: fewer finite ids than
    top_k, the sort again), top_k above the vocabulary, and on both sides of FAST_TOP_K."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 16
    logits = torch.randint(-12, 12, (rows, vocab), generator=gen).float() / 4  # many ties in value
    logits[1, : vocab // 2] = float("-inf")
    logits[2, 3:] = float("-inf")  # fewer finite candidates than top_k
    logits = logits.to(DEVICE)
    fast = sampling.FAST_TOP_K
    temperature = torch.tensor([0.9, 1.0, 0.7, 1.3] * 4, device=DEVICE)
    top_k = torch.tensor([50, 50, 50, fast, fast + 1, 1, 2, 7, 0, 50, 64, 33, fast - 1, 200, 50, 3], device=DEVICE)
    top_p = torch.tensor([1.0, 0.8, 0.5, 0.9, 0.95, 0.3, 1.0, 0.99] * 2, device=DEVICE)
    for draw in range(2):
        seeds = torch.randint(0, 1 << 60, (rows,), generator=gen).to(DEVICE)
        got = sampling.sample_rows(logits, temperature, top_k, top_p, seeds, group=draw)
        want = race_sample(logits, temperature, top_k, top_p, seeds + draw)
        assert torch.equal(got, want), (draw, got, want)
    assert bool(torch.isfinite(logits[2, got[2]]))
