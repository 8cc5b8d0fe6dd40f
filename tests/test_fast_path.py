"""The GPU fast path (Triton kernels, GPU sampling, CUDA-graph decode) against the plain torch path on the GPU,
and the ``dummy`` load format.

GPU tests (skipped without CUDA): greedy decoding over 64 steps with the fast path (CUDA graphs on, and off)
equals the eager GPU path token for token on the tiny checkpoint (fp32) and the codec codes of its talker; on
a 2-layer full-width config in bf16 the two paths' prompt logits agree to bf16 rounding and the greedy tokens
agree until the first near-tie of two logits (measured and asserted below). Seeded sampling on the fast path
does not depend on the batch. CPU tests: the GPU sampler's penalties and draws (Triton's interpreter), the
``dummy`` load format, the shipped full-size config.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.sampling import (DeviceSampler, SampleRow, TokenHistory, apply_penalties, draw_seed,
                                         draw_seeds, make_generator, race_sample)
from omni_triton.models.config import FULL_SIZE_CONFIG, OmniConfig, write_config_with_layers
from omni_triton.models.layers.attention import contiguous_batch
from omni_triton.models.layers.fast_kernels import set_fast_kernels
from omni_triton.models.weights import load_talker, load_thinker, load_thinker_embedding_rows

pytestmark = pytest.mark.engine
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 64
PROMPT_LENS = (5, 37, 16)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def full_width_2_layers(tmp_path_factory):
    return write_config_with_layers(FULL_SIZE_CONFIG, 2, tmp_path_factory.mktemp("full2"))


def gpu_engine(stage, dtype: torch.dtype, **config) -> LLMEngine:
    """The engine these tests run: up to 8 rows, 64 tokens a step, 64 KV blocks of 16 on the GPU."""
    return LLMEngine(stage, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                                         device="cuda", kv_dtype=dtype, **config))


def thinker_tokens(model, fast: bool, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   **config) -> dict[str, list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    return thinker_run(model, prompts, params, fast_path=fast, **config)[0]


def thinker_run(model, prompts, params: list[SamplingParams], arrivals: dict[int, int] | None = None, **config):
    """Tokens and finish reasons per request, and the engine (for its overlap counter). ``arrivals``: request
    index -> the engine call before which it is added (else: before the first)."""
    arrivals = arrivals or {}
    engine = gpu_engine(ThinkerStage(model), next(model.parameters()).dtype, **config)
    tokens, reasons = {}, {}
    for call in range(1000):
        for i, prompt in enumerate(prompts):
            if arrivals.get(i, 0) == call:
                engine.add_request(str(i), params[i], prompt_token_ids=prompt)
        if not engine.has_work() and call >= max(arrivals.values(), default=0):
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"the engine did not go idle: {engine.stats()}")
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return tokens, reasons, engine


def talker_codes(model, fast: bool, prompts: list[torch.Tensor], **config) -> dict[str, list[list[int]]]:
    dtype = next(model.parameters()).dtype
    zeros = torch.zeros(model.hidden_size, dtype=dtype, device="cuda")
    engine = gpu_engine(TalkerStage(model, tts_eos_embed=zeros, tts_pad_embed=zeros), dtype, fast_path=fast,
                        **config)
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), params, prompt_embeds=prompt, thinker_finished=True)
    codes: dict[str, list[list[int]]] = {}
    while engine.has_work():
        for out in engine.step():
            if "codes" in out.extras:
                codes.setdefault(out.request_id, []).append(out.extras["codes"][0].tolist())
    return codes


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def first_divergence(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@cuda
def test_tiny_thinker_greedy_fast_path_equals_eager_gpu(tiny_checkpoint):
    model = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    prompts = random_prompts(model.vocab_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    eager = thinker_tokens(model, False, prompts, params)
    assert thinker_tokens(model, True, prompts, params) == eager
    assert thinker_tokens(model, True, prompts, params, cuda_graphs=False) == eager


@cuda
def test_tiny_talker_greedy_frames_fast_path_equal_eager_gpu(tiny_checkpoint):
    model = load_talker(tiny_checkpoint, "cuda", torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, model.hidden_size, generator=gen).cuda() for n in PROMPT_LENS]
    eager = talker_codes(model, False, prompts)
    assert len(eager["0"]) == STEPS - 1  # the last token finishes the request before its frame
    assert talker_codes(model, True, prompts) == eager


@cuda
def test_seeded_sampling_on_the_fast_path_does_not_depend_on_the_batch(tiny_checkpoint):
    model = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    prompts = random_prompts(model.vocab_size, seed=3)
    sampled = [SamplingParams(temperature=1.0, top_k=k, top_p=p, repetition_penalty=1.2, seed=seed, max_new_tokens=24,
                              ignore_eos=True) for k, p, seed in ((20, 0.9, 5), (0, 0.7, 6), (3, 1.0, 7))]
    together = thinker_tokens(model, True, prompts, sampled)
    for i, (prompt, params) in enumerate(zip(prompts, sampled)):
        assert thinker_tokens(model, True, [prompt], params)["0"] == together[str(i)]
    assert len({tuple(t) for t in together.values()}) == 3


@cuda
def test_overlapped_steps_on_the_fast_path_equal_synchronous_steps(tiny_checkpoint):
    """engine/overlap.py under CUDA graphs (and eagerly): the next step's ids from the device, its sampler
    controls one token ahead (draws, the min_new_tokens ban, the device token history), a stop found while
    the next step is in flight: the synchronous engine's tokens and finishes."""
    model = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    prompts = random_prompts(model.vocab_size, seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    reference, _, _ = thinker_run(model, prompts, [greedy] * 3)
    ref = reference["0"]
    stop = next(t for i, t in enumerate(ref) if i >= 12 and t not in ref[:i])
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(stop,)),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=5,
                             max_new_tokens=30, min_new_tokens=9, stop_token_ids=(ref[0], ref[1])),
              SamplingParams(temperature=0.8, top_k=0, seed=6, max_new_tokens=35, suppressed_token_ids=(ref[2],))]
    sync = thinker_run(model, prompts, params)
    assert sync[1]["0"] == "stop"
    for config in ({}, {"cuda_graphs": False}):
        tokens, reasons, engine = thinker_run(model, prompts, params, overlap_steps=True, **config)
        assert engine.overlap.launched > 20
        assert (tokens, reasons) == sync[:2], config


@cuda
def test_overlap_admit_after_prefills_on_the_fast_path_equals_synchronous_steps(tiny_checkpoint):
    """EngineConfig.overlap_admit on the thinker under the decode and prefill CUDA graphs (and eagerly), with
    prefix caching: requests arriving mid-decode, their prompts in one chunk or several (the 64-token budget),
    some over a cached prefix; the step after one whose rows all sampled, some at the end of their prefill, goes
    ahead (its new rows' first draws and device token history one token ahead): the synchronous tokens."""
    model = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(0, model.vocab_size, (40,), generator=gen).tolist()
    tails = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in (5, 90, 3, 12, 70, 1)]
    prompts = [tails[0], shared + tails[1], tails[2], shared + tails[3], tails[4], shared[:33] + tails[5]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=5,
                             max_new_tokens=30, min_new_tokens=4, stop_token_ids=(3, 5)),
              SamplingParams(temperature=0.8, top_k=0, seed=6, max_new_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_new_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=50, seed=8, max_new_tokens=15, repetition_penalty=1.1)]
    arrivals = {2: 6, 3: 11, 4: 12, 5: 20}
    sync = thinker_run(model, prompts, params, arrivals, overlap_steps=False, prefix_caching=True)
    for config in ({}, {"cuda_graphs": False}):
        tokens, reasons, engine = thinker_run(model, prompts, params, arrivals, overlap_steps=True,
                                              overlap_admit=True, prefix_caching=True, **config)
        assert engine.overlap.launched_after_prefills >= 3 and engine.block_manager.num_hit_tokens > 0, config
        assert (tokens, reasons) == sync[:2], config
        if not config:
            assert engine.runner.prefill_graphs.replays > 0


def talker_run(model, prompts, texts, params: list[SamplingParams], feed_plan, **config):
    """Codes and finish reasons per request; ``feed_plan(call, i)`` says how many more trailing-text rows
    request i gets before engine call ``call`` (its text finishes once all are given)."""
    zeros = torch.zeros(model.hidden_size, device="cuda")
    engine = gpu_engine(TalkerStage(model, tts_eos_embed=zeros + 0.1, tts_pad_embed=zeros - 0.1), torch.float32,
                        **config)
    given = [2] * len(prompts)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), params[i], prompt_embeds=prompt, trailing_text_embeds=texts[i][:2])
    codes, reasons = {}, {}
    for call in range(400):
        for i in range(len(prompts)):
            more = feed_plan(call, i)
            if more and str(i) in engine.requests and given[i] < len(texts[i]):
                rows = texts[i][given[i]:given[i] + more]
                given[i] += len(rows)
                engine.append(str(i), trailing_text_embeds=rows, finished=given[i] == len(texts[i]))
        if not engine.has_work():
            break
        for out in engine.step():
            if "codes" in out.extras:
                codes.setdefault(out.request_id, []).extend(out.extras["codes"].tolist())
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return codes, reasons, engine


@cuda
def test_overlapped_talker_frames_equal_synchronous_frames(tiny_checkpoint):
    """The talker's overlapped steps (next input = the frame's codec embeds on the device + the trailing text
    peeked before after_sample takes it) under CUDA graphs: the synchronous engine's codes and finishes, with
    text arriving a row a call, a row starved of text for a while (it stays out of the steps launched ahead, and
    joins one when its text comes, its draws without a token ahead), the prefill step followed ahead (its frames
    completed at that launch, one token ahead), rows leaving at their max_new_tokens while the others go on,
    served sampling with a repetition penalty, and a stop in flight."""
    model = load_talker(tiny_checkpoint, "cuda", torch.float32)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(n, model.hidden_size, generator=gen).cuda() for n in PROMPT_LENS]
    texts = [torch.randn(12, model.hidden_size, generator=gen).cuda() for _ in prompts]

    def feed_plan(call, i):
        return 0 if (i == 2 and 4 <= call < 12) else 1  # request 2 starves for 8 calls

    greedy = [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)] * 3
    reference, _, _ = talker_run(model, prompts, texts, greedy, feed_plan, overlap_steps=False)
    ref = [frame[0] for frame in reference["0"]]
    stop = next(t for i, t in enumerate(ref) if i >= 12 and t not in ref[:i])
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, seed=7,
                             max_new_tokens=36, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=50, seed=8, max_new_tokens=30, ignore_eos=True)]
    sync = talker_run(model, prompts, texts, params, feed_plan, overlap_steps=False)
    codes, reasons, engine = talker_run(model, prompts, texts, params, feed_plan, overlap_steps=True)
    assert sync[1]["0"] == "stop" and sync[2].overlap is None
    assert engine.overlap is not None and engine.overlap.launched > 15
    assert engine.overlap.launched_subsets > 0 and engine.overlap.joined > 0
    assert engine.overlap.launched_after_prefills > 0
    assert (codes, reasons) == sync[:2]
    # EngineConfig.overlap_admit: the same codes
    codes, reasons, engine = talker_run(model, prompts, texts, params, feed_plan, overlap_steps=True,
                                        overlap_admit=True)
    assert engine.overlap.joined > 0
    assert (codes, reasons) == sync[:2]


def prompt_logits(model, prompt: list[int], kernels: bool) -> torch.Tensor:
    """Next-token logits after a whole prompt, one prefill through the kernels or the torch path."""
    set_fast_kernels(model, kernels)
    batch = contiguous_batch([len(prompt)], model.num_layers, model.num_kv_heads, model.head_dim,
                             dtype=torch.bfloat16, device="cuda")
    batch.use_kernels = kernels
    ids = torch.tensor(prompt, device="cuda")
    with torch.inference_mode():
        hidden, _ = model(model.embed(ids), torch.arange(len(prompt), device="cuda"), batch)
        return model.compute_logits(hidden[-1:])[0]


@cuda
def test_full_width_two_layers_bf16_fast_path_tracks_eager_gpu(full_width_2_layers):
    """bf16: the kernels sum in other orders than cuBLAS / the expert loop (fused MoE, top-k sum, decode
    attention, packed projections), so logits differ by bf16 rounding (asserted: 2% of their norm) and greedy
    decoding follows the eager path until two logits are within that noise of each other, then the paths part.
    Measured on the H100 on this random-weight config: thinker tokens equal for the first 3, 18 and 12 of 64
    steps; talker frames (16 codes each, so 16 chances of a near-tie per frame) for the first 0, 1 and 4."""
    model = load_thinker(full_width_2_layers, "cuda", torch.bfloat16, with_audio=False, load_format="dummy")
    prompts = random_prompts(model.vocab_size)
    for prompt in prompts:
        eager_logits, fast_logits = prompt_logits(model, prompt, False), prompt_logits(model, prompt, True)
        assert rel_norm_error(fast_logits, eager_logits) < 2e-2
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    eager = thinker_tokens(model, False, prompts, params)
    fast = thinker_tokens(model, True, prompts, params)
    agree = [first_divergence(eager[k], fast[k]) for k in sorted(eager)]
    print(f"\nfull-width 2-layer bf16 thinker: greedy tokens equal for the first {agree} of {STEPS} steps")
    assert min(agree) >= 1

    talker = load_talker(full_width_2_layers, "cuda", torch.bfloat16, load_format="dummy")
    gen = torch.Generator().manual_seed(1)
    embeds = [torch.randn(n, talker.hidden_size, generator=gen).to("cuda", torch.bfloat16) for n in PROMPT_LENS]
    eager_codes, fast_codes = talker_codes(talker, False, embeds), talker_codes(talker, True, embeds)
    frames = [first_divergence(eager_codes[k], fast_codes[k]) for k in sorted(eager_codes)]
    print(f"full-width 2-layer bf16 talker: codec frames equal for the first {frames} of {STEPS - 1}")
    assert all(len(codes) == STEPS - 1 for codes in fast_codes.values())


def rel_norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def device_sampler_rows(params: list[SamplingParams], seen: list[set[int]], generated: list[int]):
    rows = [SampleRow(p, make_generator(0, "cpu"), seen_ids=set(s), num_generated=n)
            for p, s, n in zip(params, seen, generated)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = DeviceSampler(len(rows), device, TokenHistory(len(rows), 40, device))
    sampler.prepare([str(i) for i in range(len(rows))], rows, generated)
    return rows, sampler


def test_device_sampler_applies_the_cpu_penalties_and_bans():
    pytest.importorskip("triton")
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.0, suppressed_token_ids=tuple(range(0, 40, 2))),
              SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(int(logits[2].argmax()),)),
              SamplingParams(temperature=1.0, top_k=1, repetition_penalty=0.5)]
    seen = [set(logits[0].topk(3).indices.tolist()), set(), set(), {5, 6}]
    rows, sampler = device_sampler_rows(params, seen, [0, 0, 1, 0])
    got = sampler.sample(logits.to(sampler._floats.device)).cpu()
    assert torch.equal(got, apply_penalties(logits.clone(), rows).argmax(-1))
    slots = [sampler.history.slot(str(i), row) for i, row in enumerate(rows)]
    assert sampler.history.seen[slots, got.tolist()].all()  # each row's history recorded its new token


def test_device_sampler_prepare_writes_each_rows_controls_and_draw_seed():
    """prepare fills its control columns at once (draw_seeds: the vectorized draw_seed); they must be what a
    row-by-row fill gives, for any seed a request may carry (negative or past 64 bits included)."""
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=-3),
              SamplingParams(temperature=0.0, seed=(1 << 70) + 5),
              SamplingParams(temperature=1.2, top_k=50, min_new_tokens=4, stop_token_ids=(7,), seed=12345)]
    rows = [SampleRow(p, make_generator(0, "cpu")) for p in params]
    sampler = DeviceSampler(4, "cpu", TokenHistory(4, 40, "cpu"))  # one row more than prepared: padding
    sampler.prepare([str(i) for i in range(len(rows))], rows, [0, 9, 2])
    floats, ints = sampler._floats.cpu(), sampler._ints.cpu()
    for i, (row, draw) in enumerate(zip(rows, [0, 9, 2])):
        p = row.params
        assert floats[:, i].tolist() == pytest.approx([p.temperature, p.top_p, p.repetition_penalty])
        assert ints[:, i].tolist() == [p.top_k, draw_seed(row.seed, draw), sampler.history.slot(str(i), row),
                                       int(row.stop_ids_banned)]
    assert ints[:, 3].tolist() == [0, 0, sampler.history.padding_slot, 0]  # past the rows: greedy padding
    assert floats[:, 3].tolist() == [0.0, 1.0, 1.0]
    many = [SampleRow(SamplingParams(temperature=1.0, seed=seed), make_generator(0, "cpu")) for seed in range(-5, 35)]
    wide = DeviceSampler(len(many), "cpu")  # past VECTOR_SEEDS_FROM rows: the seeds drawn as one numpy expression
    wide.prepare([str(i) for i in range(len(many))], many, list(range(len(many))))
    assert wide._ints[1].tolist() == [draw_seed(row.seed, draw) for draw, row in enumerate(many)]
    seeds, draws = [random.getrandbits(62) for _ in range(200)], [random.randrange(10**6) for _ in range(200)]
    assert draw_seeds(np.array(seeds, dtype=np.uint64), np.array(draws, dtype=np.uint64)).tolist() == [
        draw_seed(seed, draw) for seed, draw in zip(seeds, draws)]


def test_device_sampler_over_a_large_vocabulary_draws_what_the_torch_race_draws():
    """Past the row kernel's vocabulary, with every sampling row's top_k at most 20 (the thinker's default):
    the penalties and bans in one launch, then topk + the row kernel; the torch race over the CPU penalties
    (HF semantics) with the same draw seeds gives the same ids, and the history records them."""
    pytest.importorskip("triton")
    vocab = 6000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3, seed=1),
              SamplingParams(temperature=0.0, suppressed_token_ids=tuple(range(0, vocab, 3))),
              SamplingParams(temperature=1.0, top_k=5, min_new_tokens=3, stop_token_ids=(int(logits[2].argmax()),),
                             seed=2),
              SamplingParams(temperature=1.2, top_k=20, repetition_penalty=0.6, seed=3)]
    seen = [set(logits[0].topk(6).indices.tolist()), set(), set(), set(logits[3].topk(30).indices.tolist())]
    rows = [SampleRow(p, make_generator(0, "cpu"), seen_ids=set(s)) for p, s in zip(params, seen)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = DeviceSampler(len(rows), device, TokenHistory(len(rows), vocab, device))
    sampler.prepare([str(i) for i in range(len(rows))], rows, [4, 0, 1, 9])
    assert sampler.max_top_k == 20
    got = sampler.sample(logits.to(device)).cpu()
    def controls(values):
        return torch.tensor(values, device=device)

    seeds = controls([draw_seed(row.seed, draw) for row, draw in zip(rows, [4, 0, 1, 9])])
    temperature = controls([p.temperature for p in params])
    want = race_sample(apply_penalties(logits.clone(), rows).to(device), temperature,
                       controls([p.top_k for p in params]), controls([p.top_p for p in params]), seeds,
                       max_top_k=20).cpu()
    assert torch.equal(got, want)
    assert int(got[2]) != int(logits[2].argmax()) and int(got[1]) % 3 != 0  # the stop id and suppressed ids banned
    slots = [sampler.history.slot(str(i), row) for i, row in enumerate(rows)]
    assert sampler.history.seen[slots, got.tolist()].all()


def test_device_sampler_prepare_of_the_same_rows_again_matches_a_fresh_fill():
    """A steady batch prepares the same rows every step: only the draw seeds and stop flags are rewritten, and
    the result is what a fresh sampler writes; a history slot freed and given again (a preempted request back)
    refreshes the columns even for the same rows."""
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1), SamplingParams(temperature=0.0, seed=2),
              SamplingParams(temperature=1.0, top_k=50, min_new_tokens=2, stop_token_ids=(3,), seed=3)]
    rows = [SampleRow(p, make_generator(0, "cpu")) for p in params]
    keys = ["a", "b", "c"]

    def fresh(draws):
        sampler = DeviceSampler(4, "cpu", TokenHistory(4, 40, "cpu"))
        sampler.prepare(keys, rows, draws)
        return sampler

    steady = fresh([0, 0, 0])
    for step in range(1, 4):
        for row in rows:
            row.record(5)  # a token each: stop ids no longer banned for row c after two
        steady.prepare(keys, rows, [step] * 3)
        want = fresh([step] * 3)
        assert torch.equal(steady._floats, want._floats) and torch.equal(steady._ints, want._ints)
        assert (steady.all_greedy, steady.max_top_k) == (want.all_greedy, want.max_top_k) == (False, 50)
    history = steady.history
    history.release("c")
    history.slot("x", SampleRow(params[0], make_generator(0, "cpu")))  # another request takes c's slot
    steady.prepare(keys, rows, [4] * 3)
    assert steady._ints[2, 2] == history.slot("c", rows[2]) != history.slot("x", rows[0])


def test_race_sample_draws_follow_the_filtered_distribution_per_seed():
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1)).expand(600, -1).to(device)
    rows = 600

    def control(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=device)

    seeds = torch.tensor([draw_seed(11, draw) for draw in range(rows)], device=device)
    draws = race_sample(logits, control(0.8, torch.float32), control(6, torch.int64), control(0.9, torch.float32),
                        seeds).cpu()
    probs = (logits[0].cpu() / 0.8).softmax(-1)
    allowed = probs.topk(6).indices
    kept = allowed[:int((probs[allowed].cumsum(0) - probs[allowed] < 0.9).sum())]
    assert set(draws.tolist()) <= set(kept.tolist()) and len(set(draws.tolist())) > 1
    expected = probs[kept] / probs[kept].sum()
    observed = torch.stack([(draws == k).float().mean() for k in kept])
    assert (observed - expected).abs().max() < 0.08
    # a draw depends on its own seed only, whatever the batch around it
    alone = race_sample(logits[:1], control(0.8, torch.float32)[:1], control(6, torch.int64)[:1],
                        control(0.9, torch.float32)[:1], seeds[17:18])
    assert int(alone) == int(draws[17])


def test_dummy_load_has_the_checkpoint_shapes_and_depends_only_on_the_seed(tiny_checkpoint):
    loaded = load_thinker(tiny_checkpoint, with_audio=False)
    dummy = load_thinker(tiny_checkpoint, with_audio=False, load_format="dummy", seed=3)
    again = load_thinker(tiny_checkpoint, with_audio=False, load_format="dummy", seed=3)
    shapes = {name: p.shape for name, p in loaded.state_dict().items()}
    assert {name: p.shape for name, p in dummy.state_dict().items()} == shapes
    assert all(torch.equal(p, again.state_dict()[name]) for name, p in dummy.state_dict().items())
    rows = load_thinker_embedding_rows(tiny_checkpoint, [3, 9], load_format="dummy", seed=3)
    assert torch.equal(rows, dummy.model.embed_tokens.weight[[3, 9]])
    talker = load_talker(tiny_checkpoint, load_format="dummy")
    assert {n: p.shape for n, p in talker.state_dict().items()} == {
        n: p.shape for n, p in load_talker(tiny_checkpoint).state_dict().items()}


def test_shipped_full_size_config_has_the_released_dimensions():
    from omni_triton.models.config import resolve_config_dir

    config = OmniConfig.from_pretrained(resolve_config_dir(FULL_SIZE_CONFIG))
    thinker, talker = config.thinker.text, config.talker.text
    assert (thinker.num_layers, thinker.hidden_size, thinker.num_experts, thinker.num_experts_per_tok) == (
        48, 2048, 128, 8)
    assert (talker.num_layers, talker.num_experts, talker.shared_expert_intermediate_size) == (20, 128, 768)
    assert config.talker.code_predictor.num_layers == 5 and config.num_code_groups == 16
    assert config.code2wav.num_hidden_layers == 8 and config.code2wav.decoder_dim == 1536
