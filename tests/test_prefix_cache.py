"""Prefix caching in the engine (toy models): blocks named by content, shared, kept and evicted LRU; a request
starts after its longest cached prefix and gives the tokens, frames and streamed states it gives with the cache
off, under preemption, aborts, KV pressure and random interleavings."""

from __future__ import annotations

import random

import pytest
import torch

from engine_toy_model import ToyTalker, ToyThinker
from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.prefix_cache import token_keys
from omni_triton.engine.sequence import Sequence

pytestmark = pytest.mark.engine

SYSTEM = list(range(3, 30))  # 27 tokens: 6 full blocks of 4 and 3 positions more


@pytest.fixture(scope="module")
def thinker():
    return ToyThinker().eval()


def engine_for(model, caching: bool, accept_hidden_layer=None, **config) -> LLMEngine:
    stage = ThinkerStage(model, audio_token_id=2, accept_hidden_layer=accept_hidden_layer)
    return LLMEngine(stage, EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 32,
                                            "prefix_caching": caching, **config}))


def params(max_new_tokens: int, seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return SamplingParams(temperature=0.9, top_k=20, seed=seed, max_new_tokens=max_new_tokens)


def drain(engine: LLMEngine, tokens: dict, states: dict | None = None, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if states is not None and out.states:
                streamed = states.setdefault(out.request_id, {})
                assert out.states_start == sum(rows.shape[0] for rows in streamed.get("input_embeds", []))
                for name, rows in out.states.items():
                    streamed.setdefault(name, []).append(rows)
    raise AssertionError(f"engine did not finish: {engine.stats()}")


def alone(model, prompt, sampling, **kw) -> list[int]:
    """The request's tokens on a cache-off engine of its own."""
    engine = engine_for(model, False)
    engine.add_request("x", sampling, prompt_token_ids=prompt, **kw)
    tokens = {}
    drain(engine, tokens)
    return tokens["x"]


# -- the block manager on its own ----------------------------------------------------------------------------
def sequence(request_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id, SamplingParams(max_new_tokens=8), num_prompt_positions=len(prompt),
                   prompt_token_ids=prompt)
    seq.cache_keys = token_keys(prompt).tobytes()
    seq.keys_follow_tokens = True
    return seq


def admit(manager: BlockManager, seq: Sequence) -> list[int]:
    cached = manager.cached_prefix(seq)
    manager.take_cached(seq, cached)
    manager.allocate(seq, seq.num_inputs - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_inputs
    manager.name_computed_blocks(seq)
    return cached


def test_blocks_are_shared_by_content_kept_after_release_and_evicted_least_recently_used():
    manager = BlockManager(8, 4, prefix_caching=True)
    a = sequence("a", list(range(10)))  # 2 full blocks + 2 positions
    assert admit(manager, a) == []
    assert manager.num_cached == 2 and manager.num_used == 3
    b = sequence("b", list(range(8)) + [50, 51, 52, 53, 54])  # the same first 2 blocks, then its own
    assert admit(manager, b) == a.block_table[:2]
    assert manager.ref_counts[a.block_table[0]] == 2 and manager.num_used == 5  # 3 + 2 of its own
    c = sequence("c", list(range(8)))  # all 8 positions cached, but the last one is computed: 1 block taken
    assert admit(manager, c) == a.block_table[:1]
    manager.free(a)
    manager.free(b)
    manager.free(c)
    assert manager.num_used == 0 and manager.num_free == 8
    cached_before = manager.num_cached
    assert cached_before == 3  # a's 2 full blocks (b took them, c computed its second again) and b's third
    # 8 blocks free, of which 5 unnamed: a request needing 7 evicts the 2 least recently used named ones
    d = sequence("d", [60 + i for i in range(28)])
    admit(manager, d)
    assert manager.num_evictions == 2 and manager.num_cached == cached_before - 2 + 7
    # the tails went first (b's third, then the second block): the first block is still named
    e = sequence("e", list(range(10)))
    assert len(manager.cached_prefix(e)) == 1


def test_a_different_recording_never_shares_an_audio_block(thinker):
    prompt = [5, 6] + [2] * 6 + [7, 8, 9]
    audio = torch.randn(6, thinker.hidden_size, generator=torch.Generator().manual_seed(0))
    other = torch.randn(6, thinker.hidden_size, generator=torch.Generator().manual_seed(1))
    engine = engine_for(thinker, True)
    tokens = {}
    engine.add_request("first", params(3), prompt_token_ids=prompt, audio_embeds=audio)
    drain(engine, tokens)
    engine.add_request("other", params(3), prompt_token_ids=prompt, audio_embeds=other)
    drain(engine, tokens)
    assert engine.stats().prefix_hit_tokens == 0
    engine.add_request("same", params(3), prompt_token_ids=prompt, audio_embeds=audio)
    drain(engine, tokens)
    assert engine.stats().prefix_hit_tokens == 8  # 2 full blocks of 4; the third holds the last prompt position
    assert tokens["same"] == tokens["first"] == alone(thinker, prompt, params(3), audio_embeds=audio)
    assert tokens["other"] == alone(thinker, prompt, params(3), audio_embeds=other)


# -- whole engine against the cache off ----------------------------------------------------------------------
def conversation(turns: int, seed: int) -> list[list[int]]:
    """Prompts of a conversation: each turn's prompt is the last one + a reply + a new user turn."""
    rng = random.Random(seed)
    prompts, prompt = [], list(SYSTEM)
    for _ in range(turns):
        prompt = prompt + [rng.randrange(3, 60) for _ in range(rng.randint(3, 11))]
        prompts.append(prompt)
        prompt = prompt + [rng.randrange(3, 60) for _ in range(rng.randint(2, 9))]
    return prompts


def test_a_conversation_pays_only_for_each_turns_new_tokens_with_the_same_tokens_and_states(thinker):
    prompts = conversation(4, seed=0)
    results = {}
    for caching in (False, True):
        engine = engine_for(thinker, caching, accept_hidden_layer=2)
        tokens, states = {}, {}
        computed = []
        for turn, prompt in enumerate(prompts):
            before = engine.stats().prefix_hit_tokens
            engine.add_request(f"t{turn}", params(6), prompt_token_ids=prompt)
            drain(engine, tokens, states)
            computed.append(len(prompt) - (engine.stats().prefix_hit_tokens - before))
        results[caching] = tokens, states, computed, engine.stats()
    tokens_off, states_off, computed_off, _ = results[False]
    tokens_on, states_on, computed_on, stats = results[True]
    assert tokens_on == tokens_off
    for request_id, by_name in states_off.items():
        for name, rows in by_name.items():
            torch.testing.assert_close(torch.cat(states_on[request_id][name]), torch.cat(rows))
    assert computed_off == [len(p) for p in prompts]
    for turn in range(1, len(prompts)):  # every turn after the first computes less than its last turn's prefix
        assert computed_on[turn] <= len(prompts[turn]) - len(prompts[turn - 1]) + 4
    assert stats.prefix_hit_tokens > 0 and stats.prefix_query_tokens == sum(len(p) for p in prompts)


def test_a_reply_computed_again_as_a_prompt_takes_over_its_blocks_with_their_states(thinker):
    engine = engine_for(thinker, True, accept_hidden_layer=2)
    tokens, states = {}, {}
    engine.add_request("turn1", params(13), prompt_token_ids=SYSTEM)
    drain(engine, tokens, states)
    # the reply's blocks are named, but carry no kept states (decode rows keep none): the next turn computes them
    follow_up = SYSTEM + tokens["turn1"] + [44, 45, 46]
    engine.add_request("turn2", params(4), prompt_token_ids=follow_up)
    drain(engine, tokens, states)
    first_hits = engine.stats().prefix_hit_tokens
    assert first_hits == 24
    engine.add_request("again", params(4), prompt_token_ids=follow_up)  # now its blocks carry states
    drain(engine, tokens, states)
    assert engine.stats().prefix_hit_tokens - first_hits == (len(follow_up) - 1) // 4 * 4
    reference = engine_for(thinker, False, accept_hidden_layer=2)
    reference_tokens, reference_states = {}, {}
    reference.add_request("again", params(4), prompt_token_ids=follow_up)
    drain(reference, reference_tokens, reference_states)
    assert tokens["again"] == tokens["turn2"] == reference_tokens["again"]
    for name, rows in reference_states["again"].items():
        torch.testing.assert_close(torch.cat(states["again"][name]), torch.cat(rows))


def test_requests_sharing_a_system_prompt_run_together_on_shared_blocks(thinker):
    prompts = [SYSTEM + [40 + i, 41, 42 + i] for i in range(6)]
    engine = engine_for(thinker, True, max_num_batched_tokens=64)
    engine.add_request("first", params(4), prompt_token_ids=prompts[0])
    tokens = {"first": engine.step()[0].new_token_ids}  # its prompt computed: the system prompt's blocks named
    for i, prompt in enumerate(prompts[1:], 1):
        engine.add_request(f"r{i}", params(4, seed=i), prompt_token_ids=prompt)
    while not engine.requests["r1"].block_table:  # (a step launched ahead of the first's prefill may come first)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    shared = engine.requests["r1"].block_table[0]
    assert all(engine.requests[f"r{i}"].block_table[0] == shared for i in range(1, 6))
    assert engine.block_manager.ref_counts[shared] == 6  # the five and the first (still decoding)
    drain(engine, tokens)
    assert tokens["first"] == alone(thinker, prompts[0], params(4))
    for i in range(1, 6):
        assert tokens[f"r{i}"] == alone(thinker, prompts[i], params(4, seed=i))
    assert engine.stats().prefix_hit_tokens == 5 * 24
    assert engine.block_manager.num_used == 0 and engine.stats().prefix_cached_blocks > 0


def test_preemption_and_kv_pressure_evict_and_recompute_to_the_same_tokens(thinker):
    prompts = [SYSTEM + [40 + i] * (5 + 3 * i) for i in range(5)]
    # 20 blocks of 4: a request takes up to 14 blocks, so five at once preempt, and named blocks get evicted
    engine = engine_for(thinker, True, num_blocks=20, max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", params(12, seed=i if i % 2 else None), prompt_token_ids=prompt)
    tokens = {}
    drain(engine, tokens)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_evictions > 0 and stats.prefix_hit_tokens > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == alone(thinker, prompt, params(12, seed=i if i % 2 else None))
    assert engine.block_manager.num_used == 0


def test_abort_releases_shared_blocks_and_keeps_what_the_others_computed(thinker):
    engine = engine_for(thinker, True, max_num_batched_tokens=8)
    tokens = {}

    def step():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request("a", params(20), prompt_token_ids=SYSTEM + [44, 45])
    for _ in range(5):
        step()  # a's prompt (29 positions) computed in chunks of 8, then a token or two
    engine.add_request("b", params(20), prompt_token_ids=SYSTEM + [46])
    while not engine.requests["b"].block_table:
        step()
    assert engine.requests["b"].num_cached_tokens == 24
    engine.abort("a")
    assert engine.block_manager.ref_counts[engine.requests["b"].block_table[0]] == 1
    drain(engine, tokens)
    engine.abort("b")  # finished already: nothing
    assert tokens["b"] == alone(thinker, SYSTEM + [46], params(20))
    assert engine.block_manager.num_used == 0 and engine.stats().prefix_cached_blocks >= 6


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_give_the_tokens_of_the_cache_off(thinker, seed):
    rng = random.Random(seed)
    bases = [SYSTEM, SYSTEM[:13], list(range(40, 52))]
    engine = engine_for(thinker, True, num_blocks=rng.choice([16, 20, 40]),
                        max_num_batched_tokens=rng.choice([8, 16, 48]), accept_hidden_layer=rng.choice([None, 1]))
    expected, tokens, aborted, live = {}, {}, set(), []
    for request in range(14):
        for _ in range(rng.randint(0, 4)):
            if engine.has_work():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if live and rng.random() < 0.25:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        prompt = rng.choice(bases) + [rng.randrange(3, 60) for _ in range(rng.randint(1, 10))]
        if rng.random() < 0.3 and expected:  # a later turn of an earlier request's conversation
            earlier = rng.choice(list(expected))
            prompt = expected[earlier][0] + expected[earlier][2][:3] + prompt[-3:]
        sampling = params(rng.randint(1, 14), seed=rng.choice([None, request]))
        request_id = f"r{request}"
        engine.add_request(request_id, sampling, prompt_token_ids=prompt)
        expected[request_id] = (prompt, sampling, alone(thinker, prompt, sampling))
        live = [r for r in engine.requests]
    drain(engine, tokens)
    for request_id, (prompt, sampling, reference) in expected.items():
        got = tokens.get(request_id, [])
        if request_id in aborted:
            assert got == reference[:len(got)]
        else:
            assert got == reference, request_id
    assert engine.block_manager.num_used == 0
    assert sum(engine.block_manager.ref_counts) == 0
    assert engine.stats().prefix_hit_tokens > 0


# -- the talker: its prompt embeddings name its blocks ---------------------------------------------------------
@pytest.fixture(scope="module")
def talker():
    return ToyTalker().eval()


def talker_frames(talker, caching: bool, prompts: list[torch.Tensor]) -> tuple[list, LLMEngine]:
    eos, pad = torch.zeros(talker.hidden_size), torch.full((talker.hidden_size,), 0.1)
    engine = LLMEngine(TalkerStage(talker, tts_eos_embed=eos, tts_pad_embed=pad),
                       EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32, prefix_caching=caching))
    frames = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", SamplingParams(temperature=0.0, max_new_tokens=6), prompt_embeds=prompt,
                           trailing_text_embeds=torch.randn(3, talker.hidden_size,
                                                            generator=torch.Generator().manual_seed(i)),
                           thinker_finished=True)
        codes = []
        while engine.has_work():
            for out in engine.step():
                if "codes" in out.extras:
                    codes.append(out.extras["codes"])
        frames.append(torch.cat(codes))
    return frames, engine


def test_the_talker_reuses_blocks_of_equal_prompt_embeddings(talker):
    rows = torch.randn(30, talker.hidden_size, generator=torch.Generator().manual_seed(5))
    prompts = [rows[:13], torch.cat([rows[:21], rows[25:]]), rows]  # each later prompt repeats the first 12 rows
    frames_off, _ = talker_frames(talker, False, prompts)
    frames_on, engine = talker_frames(talker, True, prompts)
    for off, on in zip(frames_off, frames_on):
        assert torch.equal(off, on)
    # the second takes the first's 3 full blocks; the third its first 5 (20 rows in common with the second)
    assert engine.stats().prefix_hit_tokens == 12 + 20


# -- the tiny checkpoint's thinker: real layers, audio rows, the streamed states the talker reads ----------------
@pytest.fixture(scope="module")
def tiny_thinker(tiny_checkpoint):
    from omni_triton.models.config import OmniConfig
    from omni_triton.models.weights import load_thinker

    config = OmniConfig.from_pretrained(tiny_checkpoint)
    return load_thinker(tiny_checkpoint, with_audio=False).eval(), config


def tiny_engine(tiny_thinker, caching: bool, **config) -> LLMEngine:
    model, omni = tiny_thinker
    stage = ThinkerStage(model, audio_token_id=omni.thinker.audio_token_id,
                         accept_hidden_layer=omni.accept_hidden_layer)
    return LLMEngine(stage, EngineConfig(**{"block_size": 8, "num_blocks": 48, "max_num_batched_tokens": 24,
                                            "prefix_caching": caching, **config}))


@pytest.mark.parametrize("seed", range(2))
def test_tiny_thinker_interleavings_give_the_tokens_and_states_of_the_cache_off(tiny_thinker, seed):
    model, omni = tiny_thinker
    rng = random.Random(seed)
    audio_id = omni.thinker.audio_token_id
    recordings = [torch.randn(6, model.hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    system = [rng.randrange(10, 500) for _ in range(21)]
    requests = []
    for index in range(8):
        prompt = system + [rng.randrange(10, 500) for _ in range(rng.randint(2, 12))]
        inputs = {}
        if rng.random() < 0.5:  # a spoken turn: one of two recordings, then text
            recording = rng.randrange(2)
            prompt = prompt + [audio_id] * 6 + [rng.randrange(10, 500) for _ in range(3)]
            inputs = {"audio_embeds": recordings[recording], "audio_key": bytes([recording])}
        if requests and rng.random() < 0.4:  # the next turn of an earlier conversation (a text turn)
            earlier_prompt, inputs = requests[rng.randrange(len(requests))][1:3]
            prompt = earlier_prompt + [rng.randrange(10, 500) for _ in range(rng.randint(3, 9))]
        requests.append((f"r{index}", prompt, inputs, params(rng.randint(2, 8), seed=rng.choice([None, index]))))

    def run(caching: bool, interleaved: bool):
        engine = tiny_engine(tiny_thinker, caching, num_blocks=rng.choice([24, 48]) if interleaved else 48)
        tokens, states = {}, {}
        for request_id, prompt, inputs, sampling in requests:
            engine.add_request(request_id, sampling, prompt_token_ids=prompt, **inputs)
            if interleaved:
                for _ in range(rng.randint(0, 3)):
                    for out in engine.step():
                        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                        for name, rows in out.states.items():
                            states.setdefault(out.request_id, {}).setdefault(name, []).append(rows)
            else:
                drain(engine, tokens, states)
        drain(engine, tokens, states)
        return tokens, states, engine.stats()

    tokens_off, states_off, _ = run(False, interleaved=False)
    tokens_on, states_on, stats = run(True, interleaved=True)
    assert tokens_on == tokens_off
    for request_id, by_name in states_off.items():
        for name, rows in by_name.items():
            torch.testing.assert_close(torch.cat(states_on[request_id][name]), torch.cat(rows), msg=request_id)
    assert stats.prefix_hit_tokens > 0


# -- on the GPU fast path (skipped without CUDA; benchmarks/gpu_tests.sh runs them) --------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def conversation_and_shared_prompt_run(tiny_checkpoint, device: str, caching: bool, **config):
    """A three-turn conversation and three requests under one system prompt, one after the other (each drained
    before the next: later ones find the earlier ones' blocks): their tokens and streamed states."""
    from omni_triton.models.config import OmniConfig
    from omni_triton.models.weights import load_thinker

    omni = OmniConfig.from_pretrained(tiny_checkpoint)
    model = load_thinker(tiny_checkpoint, device, torch.float32, with_audio=False).eval()
    stage = ThinkerStage(model, audio_token_id=omni.thinker.audio_token_id,
                         accept_hidden_layer=omni.accept_hidden_layer)
    engine = LLMEngine(stage, EngineConfig(**{"block_size": 16, "num_blocks": 64, "max_num_seqs": 8,
                                              "max_num_batched_tokens": 64, "device": device, "prefix_caching": caching,
                                              **config}))
    rng = random.Random(4)

    def words(count: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(count)]

    system, turn = words(53), []
    prompts = []
    for index in range(3):  # each turn's prompt: the last one, a reply, a new question (fixed, not generated)
        turn = (turn + words(7) if turn else system) + words(11 + index)
        prompts.append(turn)
    prompts += [system + words(5 + index) for index in range(3)]
    tokens, states = {}, {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", params(12), prompt_token_ids=prompt)
        drain(engine, tokens, states)
    return tokens, states, engine.stats()


@cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_gpu_fast_path_with_the_cache_gives_the_tokens_and_states_of_the_cache_off(tiny_checkpoint, cuda_graphs):
    """Kept hidden states (device tensors written outside the graphs) streamed for cached positions, and prefills
    that start mid-prompt (a chunk over cached context, under the prefill graphs): the same tokens and states as
    the cache off, in fp32 on the fast path."""
    tokens_off, states_off, _ = conversation_and_shared_prompt_run(tiny_checkpoint, "cuda", False,
                                                                   cuda_graphs=cuda_graphs)
    tokens_on, states_on, stats = conversation_and_shared_prompt_run(tiny_checkpoint, "cuda", True,
                                                                     cuda_graphs=cuda_graphs)
    assert stats.prefix_hit_tokens >= 2 * 48 + 3 * 48  # later turns and the shared prompt's requests hit
    assert tokens_on == tokens_off
    for request_id, by_name in states_off.items():
        for name, rows in by_name.items():
            torch.testing.assert_close(torch.cat(states_on[request_id][name]), torch.cat(rows), rtol=1e-4, atol=1e-4,
                                       msg=f"{request_id} {name}")
