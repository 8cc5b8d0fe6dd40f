"""The AR engine on tiny stand-in models: batching, chunked prefill, preemption, abort, talker input waits,
seeded sampling, the threaded loop, and the fast attention path against the reference one."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_toy_model import ToyTalker, ToyThinker, reference_greedy
from omni_triton.engine import (EngineConfig, EngineLoop, LLMEngine, RequestOutput, SamplingParams, SequenceStatus,
                                TalkerStage, ThinkerStage)
from omni_triton.engine.block_manager import kv_bytes_per_block, num_blocks_for_budget
from omni_triton.engine.sampling import SampleRow, make_generator, sample
from omni_triton.models.layers.attention import AttentionBatch, contiguous_batch

pytestmark = pytest.mark.engine

PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 11, list(range(20, 2, -1)), [9, 8, 7, 6, 5, 4, 3]]
MAX_NEW = [12, 7, 20, 15, 9]


@pytest.fixture(scope="module")
def thinker():
    return ToyThinker().eval()


@pytest.fixture(scope="module")
def expected(thinker):
    """Greedy ids of PROMPTS, each run alone without any KV reuse."""
    return [reference_greedy(thinker, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def run_to_completion(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine did not finish in {max_steps} steps: {engine.stats()}")


def thinker_engine(model, **config) -> LLMEngine:
    return LLMEngine(ThinkerStage(model), EngineConfig(**{"block_size": 4, "num_blocks": 256, **config}))


def test_batched_greedy_matches_reference_token_for_token(thinker, expected):
    # a small token budget forces chunked prefills mixed with other requests' decodes
    engine = thinker_engine(thinker, max_num_batched_tokens=16)
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        engine.add_request(f"r{i}", greedy(n), prompt_token_ids=prompt)
    got = run_to_completion(engine)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_preemption_by_recompute_keeps_outputs_identical(thinker, expected):
    # 18 blocks x 4 slots: the longest request alone needs 12 blocks, so running all five must preempt
    engine = thinker_engine(thinker, num_blocks=18, max_num_batched_tokens=32)
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        engine.add_request(f"r{i}", greedy(n), prompt_token_ids=prompt)
    got = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_captured_states_are_streamed_once_per_position_even_after_preemption(thinker):
    engine = LLMEngine(ThinkerStage(thinker, accept_hidden_layer=2),
                       EngineConfig(block_size=4, num_blocks=18, max_num_batched_tokens=32))
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        engine.add_request(f"r{i}", greedy(n), prompt_token_ids=prompt)
    rows: dict[str, list[torch.Tensor]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.states:
                rows.setdefault(out.request_id, []).append(out.states["input_embeds"])
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        embeds = torch.cat(rows[f"r{i}"])
        fed = prompt + tokens[f"r{i}"][:-1]  # the last sampled token is never fed back
        assert embeds.shape[0] == len(fed)
        torch.testing.assert_close(embeds, thinker.embed(torch.tensor(fed)))


def test_a_stage_streaming_its_prompts_states_only_streams_those_rows_once_and_the_same_tokens(thinker):
    """``states_past_prompt=False`` (the thinker service's stage): the states of prompt positions only, once
    each, equal to what the default streams for them, even after preemption; the tokens are the same."""
    def run(states_past_prompt: bool):
        engine = LLMEngine(ThinkerStage(thinker, accept_hidden_layer=2, states_past_prompt=states_past_prompt),
                           EngineConfig(block_size=4, num_blocks=18, max_num_batched_tokens=32))
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
            engine.add_request(f"r{i}", greedy(n), prompt_token_ids=prompt)
        rows: dict[str, list[dict]] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.states:
                    rows.setdefault(out.request_id, []).append(out.states)
        assert engine.scheduler.num_preemptions > 0
        return tokens, {rid: {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
                        for rid, parts in rows.items()}

    tokens, states = run(True)
    prompt_tokens, prompt_states = run(False)
    assert prompt_tokens == tokens
    for i, prompt in enumerate(PROMPTS):
        for name, rows in prompt_states[f"r{i}"].items():
            assert rows.shape[0] == len(prompt)
            torch.testing.assert_close(rows, states[f"r{i}"][name][:len(prompt)])


def test_audio_embeds_replace_audio_placeholders_across_prefill_chunks(thinker):
    audio_id, prompt = 3, [1, 2, 3, 3, 3, 3, 3, 9, 10]
    audio = torch.randn(5, thinker.hidden_size, generator=torch.Generator().manual_seed(0))
    expected_embeds = thinker.embed(torch.tensor(prompt))
    expected_embeds[2:7] = audio
    batch = contiguous_batch([len(prompt)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                             dtype=torch.float32)
    with torch.no_grad():
        hidden, _ = thinker(expected_embeds, torch.arange(len(prompt)), batch)
    engine = LLMEngine(ThinkerStage(thinker, audio_token_id=audio_id, accept_hidden_layer=1),
                       EngineConfig(block_size=4, num_blocks=16, max_num_batched_tokens=4))
    engine.add_request("a", greedy(1), prompt_token_ids=prompt, audio_embeds=audio)
    outputs = [out for _ in range(3) for out in engine.step()]
    torch.testing.assert_close(torch.cat([o.states["input_embeds"] for o in outputs]), expected_embeds)
    assert outputs[-1].new_token_ids == [int(thinker.compute_logits(hidden[-1:]).argmax())]
    with pytest.raises(ValueError, match="4 audio embeds for 5 audio tokens"):
        engine.add_request("b", greedy(1), prompt_token_ids=prompt, audio_embeds=audio[:4])


def test_abort_frees_every_block_in_any_state(thinker):
    engine = thinker_engine(thinker, num_blocks=18, max_num_batched_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", greedy(30), prompt_token_ids=prompt)
    for _ in range(6):
        engine.step()
    states = {seq.status for seq in engine.requests.values()}
    assert SequenceStatus.RUNNING in states and SequenceStatus.WAITING in states
    assert engine.block_manager.num_used > 0
    for request_id in list(engine.requests):
        out = engine.abort(request_id)
        assert out.finished and out.finish_reason == "abort"
    assert engine.abort("r0") is None
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.has_work() and engine.requests == {}


def test_stop_ids_min_and_max_new_tokens(thinker):
    free_run = reference_greedy(thinker, PROMPTS[1], 20)
    stop = free_run[3]
    first_stop = free_run.index(stop)
    engine = thinker_engine(thinker)
    engine.add_request("stop", greedy(20, stop_token_ids=(stop,)), prompt_token_ids=PROMPTS[1])
    engine.add_request("ignore", greedy(20, stop_token_ids=(stop,), ignore_eos=True), prompt_token_ids=PROMPTS[1])
    engine.add_request("min", greedy(20, stop_token_ids=(stop,), min_new_tokens=first_stop + 2),
                       prompt_token_ids=PROMPTS[1])
    finals = {}
    got = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert got["stop"] == free_run[:first_stop + 1] and finals["stop"] == "stop"
    assert got["ignore"] == free_run and finals["ignore"] == "length"
    assert stop not in got["min"][:first_stop + 2]


def test_seeded_sampling_is_independent_of_batch_composition(thinker):
    params = dict(temperature=1.3, top_k=20, top_p=0.9, repetition_penalty=1.1, max_new_tokens=15)

    def run(requests):
        engine = thinker_engine(thinker, max_num_batched_tokens=24)
        for request_id, prompt, seed in requests:
            engine.add_request(request_id, SamplingParams(seed=seed, **params), prompt_token_ids=prompt)
        return run_to_completion(engine)

    alone = run([("a", PROMPTS[0], 123)])["a"]
    crowded = run([("x", PROMPTS[1], 5), ("a", PROMPTS[0], 123), ("y", PROMPTS[2], 6), ("z", PROMPTS[0], 7)])
    assert crowded["a"] == alone
    assert crowded["z"] != alone  # same prompt, another seed: sampling really happens


def test_sampling_processors_match_transformers():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = [[1, 2, 3, 3], [4, 40], [7]]
    rows = [SampleRow(SamplingParams(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.3),
                      make_generator(0, "cpu"), seen_ids=set(h)) for h in history]
    from omni_triton.engine.sampling import apply_penalties, warp
    ours = warp(apply_penalties(logits.clone(), rows), rows)
    ids = torch.tensor([h + [h[-1]] * (4 - len(h)) for h in history])  # padding repeats an id: no effect
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    for warper in (transformers.TemperatureLogitsWarper(0.7), transformers.TopKLogitsWarper(10),
                   transformers.TopPLogitsWarper(0.8)):
        hf = warper(ids, hf)
    torch.testing.assert_close(ours, hf.softmax(-1))
    # suppressed ids are never drawn; top_k=1 is greedy
    row = SampleRow(SamplingParams(temperature=1.0, suppressed_token_ids=tuple(range(25))), make_generator(1, "cpu"))
    draws = sample(logits[:1].expand(200, -1).clone(), [row] * 200)
    assert draws.min() >= 25
    row = SampleRow(SamplingParams(temperature=2.0, top_k=1), make_generator(1, "cpu"))
    assert sample(logits.clone(), [row] * 3).tolist() == logits.argmax(-1).tolist()


def test_kv_budget_sets_block_count():
    per_block = kv_bytes_per_block(16, 48, 4, 128, torch.bfloat16)
    assert per_block == 2 * 48 * 16 * 4 * 128 * 2
    assert num_blocks_for_budget(10 * per_block + 1, 16, 48, 4, 128, torch.bfloat16) == 10
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(per_block - 1, 16, 48, 4, 128, torch.bfloat16)


def test_request_longer_than_the_cache_is_rejected(thinker):
    engine = thinker_engine(thinker, num_blocks=4)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        engine.add_request("big", greedy(10), prompt_token_ids=list(range(10)))


# -- talker -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def talker():
    return ToyTalker().eval()


def talker_engine(talker, **config):
    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    return LLMEngine(stage, EngineConfig(**{"block_size": 4, "num_blocks": 128, **config}))


def talker_inputs(seed: int, prefill: int, text: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(prefill, 32, generator=gen), torch.randn(text, 32, generator=gen)


def collect(outputs, tokens, frames):
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if "codes" in out.extras:
            frames.setdefault(out.request_id, []).append(out.extras["codes"])


def test_talker_waiting_for_input_never_delays_the_others(talker):
    prefill_a, text_a = talker_inputs(0, 9, 6)
    prefill_b, text_b = talker_inputs(1, 12, 3)
    params = greedy(14)

    # oracle: both requests alone with all their text given up front
    alone_tokens, alone_frames = {}, {}
    for request_id, prefill, text in (("a", prefill_a, text_a), ("b", prefill_b, text_b)):
        engine = talker_engine(talker)
        engine.add_request(request_id, params, prompt_embeds=prefill, trailing_text_embeds=text, thinker_finished=True)
        while engine.has_work():
            collect(engine.step(), alone_tokens, alone_frames)

    engine = talker_engine(talker)
    engine.add_request("a", params, prompt_embeds=prefill_a, trailing_text_embeds=text_a[:2])
    engine.add_request("b", params, prompt_embeds=prefill_b, trailing_text_embeds=text_b, thinker_finished=True)
    tokens, frames = {}, {}
    collect(engine.step(), tokens, frames)  # both prefills
    for _ in range(5):  # a consumes its 2 text rows, then waits; b decodes every step regardless
        before = len(tokens.get("b", []))
        collect(engine.step(), tokens, frames)
        assert len(tokens["b"]) == before + 1
    assert engine.requests["a"].status == SequenceStatus.WAITING_FOR_INPUT
    assert engine.stats().num_waiting_for_input == 1 and len(tokens["a"]) == 3
    engine.append("a", trailing_text_embeds=text_a[2:], finished=True)
    assert engine.requests["a"].status == SequenceStatus.RUNNING
    while engine.has_work():
        collect(engine.step(), tokens, frames)
    assert tokens == alone_tokens
    for request_id in ("a", "b"):
        torch.testing.assert_close(torch.cat(frames[request_id]), torch.cat(alone_frames[request_id]))
        assert len(frames[request_id]) == len(tokens[request_id]) - 1  # the last code0 makes no frame
        assert (torch.cat(frames[request_id])[:, 0] == torch.tensor(tokens[request_id][:-1])).all()


def test_talker_preempted_while_waiting_for_input_resumes_identically(talker):
    prefill_a, text_a = talker_inputs(2, 10, 5)
    prefill_b, text_b = talker_inputs(3, 14, 2)
    params_a = SamplingParams(temperature=0.9, top_k=20, seed=11, max_new_tokens=12)
    params_b = greedy(18)
    ref_tokens, ref_frames = {}, {}
    for request_id, params, prefill, text in (("a", params_a, prefill_a, text_a), ("b", params_b, prefill_b, text_b)):
        engine = talker_engine(talker)
        engine.add_request(request_id, params, prompt_embeds=prefill, trailing_text_embeds=text, thinker_finished=True)
        while engine.has_work():
            collect(engine.step(), ref_tokens, ref_frames)

    # 8 blocks x 4 slots: b alone grows to all 8, so a (newer, waiting for text) must be preempted
    engine = talker_engine(talker, num_blocks=8)
    engine.add_request("b", params_b, prompt_embeds=prefill_b, trailing_text_embeds=text_b, thinker_finished=True)
    engine.add_request("a", params_a, prompt_embeds=prefill_a, trailing_text_embeds=text_a[:1])
    tokens, frames = {}, {}
    for _ in range(40):
        collect(engine.step(), tokens, frames)
        if engine.scheduler.num_preemptions:
            break
    assert engine.scheduler.num_preemptions == 1
    assert engine.requests["a"].status == SequenceStatus.WAITING and engine.requests["a"].num_generated == 2
    engine.append("a", trailing_text_embeds=text_a[1:], finished=True)
    while engine.has_work():
        collect(engine.step(), tokens, frames)
    assert tokens == ref_tokens
    for request_id in ("a", "b"):
        torch.testing.assert_close(torch.cat(frames[request_id]), torch.cat(ref_frames[request_id]))


def talker_alone(talker, params, prefill, text):
    """Request "a" with all its text at once, stepped by hand: the reference for the threaded loop."""
    tokens, frames = {}, {}
    engine = talker_engine(talker)
    engine.add_request("a", params, prompt_embeds=prefill, trailing_text_embeds=text, thinker_finished=True)
    while engine.has_work():
        collect(engine.step(), tokens, frames)
    return tokens, frames


def assert_same_as_alone(delivered, ref_tokens, ref_frames):
    """Request "a"'s delivered outputs carry the tokens and frames of ``talker_alone``."""
    tokens, frames = {}, {}
    collect(delivered, tokens, frames)
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.cat(frames["a"]), torch.cat(ref_frames["a"]))


# -- threaded loop ------------------------------------------------------------------------------------------
def test_engine_loop_streams_outputs_and_never_waits_on_a_slow_consumer(thinker, expected):
    loop = EngineLoop(thinker_engine(thinker, max_num_batched_tokens=16)).start()
    try:
        release = threading.Event()
        slow_outputs = []

        def slow_consumer(output):  # blocks the response thread until released
            release.wait(10)
            slow_outputs.append(output)

        loop.add_request("slow", greedy(10), callback=slow_consumer, prompt_token_ids=PROMPTS[0])
        streams = [loop.add_request(f"r{i}", greedy(n), prompt_token_ids=p)
                   for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
        deadline = time.time() + 30
        while loop.engine.requests and time.time() < deadline:  # the engine finishes everything meanwhile
            time.sleep(0.01)
        assert not loop.engine.requests
        release.set()
        got = [[t for out in stream for t in out.new_token_ids] for stream in streams]
        assert got == expected
        aborted = loop.add_request("abort-me", greedy(900), prompt_token_ids=PROMPTS[1])
        loop.abort("abort-me")
        outputs = list(aborted)
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
        bad = list(loop.add_request("bad", greedy(5), prompt_token_ids=[]))
        assert bad[-1].finished and bad[-1].finish_reason.startswith("error")
        while slow_outputs == [] or not slow_outputs[-1].finished:
            time.sleep(0.01)
        assert loop.stats().kv_blocks_used == 0
    finally:
        loop.shutdown()


def test_engine_loop_talker_appends_from_another_thread(talker):
    prefill, text = talker_inputs(4, 8, 4)
    params = greedy(10)
    ref_tokens, ref_frames = talker_alone(talker, params, prefill, text)

    loop = EngineLoop(talker_engine(talker)).start()
    try:
        stream = loop.add_request("a", params, prompt_embeds=prefill, trailing_text_embeds=text[:1])
        deadline = time.time() + 10
        while loop.stats().num_waiting_for_input != 1 and time.time() < deadline:
            time.sleep(0.005)
        assert loop.stats().num_waiting_for_input == 1
        for row in text[1:]:  # text trickles in one row at a time, as the thinker produces it
            loop.append("a", trailing_text_embeds=row[None])
        loop.append("a", finished=True)
        tokens, frames = {}, {}
        collect(list(stream), tokens, frames)
    finally:
        loop.shutdown()
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.cat(frames["a"]), torch.cat(ref_frames["a"]))


def test_merge_outputs_concatenates_a_requests_outputs_in_order():
    from omni_triton.engine.engine import merge_outputs

    def out(request_id, tokens, start=0, rows=0, finished=False, reason=None, codes=None):
        states = {"input_embeds": torch.full((rows, 2), float(start))} if rows else {}
        extras = {"codes": codes} if codes is not None else {}
        return RequestOutput(request_id, tokens, finished, reason, states, start, extras)

    merged = merge_outputs([
        out("a", [], start=0, rows=3), out("b", [7], codes=torch.tensor([[1, 2]])), out("a", [5], start=3, rows=1),
        out("b", [8], codes=torch.tensor([[3, 4]]), finished=True, reason="length"),
        out("b", [9]),  # the id reused by a new request after its request finished: not merged into it
    ])
    assert [(m.request_id, m.new_token_ids, m.finished) for m in merged] == [
        ("a", [5], False), ("b", [7, 8], True), ("b", [9], False)]
    a = merged[0]
    assert a.states_start == 0 and a.states["input_embeds"][:, 0].tolist() == [0.0, 0.0, 0.0, 3.0]
    assert merged[1].finish_reason == "length" and merged[1].extras["codes"].tolist() == [[1, 2], [3, 4]]


def test_outputs_gathered_over_rounds_merge_once_into_what_merging_them_at_once_makes():
    """The response thread holds a request's outputs over rounds as GatheredOutputs (a part a round) and merges them
    only when it delivers: the same output as merging all the parts at once, the states starting where the first
    part with states starts, a lone part delivered as it is."""
    from omni_triton.engine.engine import gather_outputs, merge_outputs

    def out(tokens, start=0, rows=0, codes=None, ids=None, events=(), finished=False):
        states = {"input_embeds": torch.full((rows, 2), float(start))} if rows else {}
        extras = {"codes": torch.tensor(codes)} if codes is not None else {}
        ids = torch.tensor(ids) if ids is not None else None
        return RequestOutput("a", tokens, finished, "stop" if finished else None, states, start, extras, ids, events)

    parts = [out([1], codes=[[1, 2]], ids=[1], events=("e1",)),
             out([2], start=4, rows=2, codes=[[3, 4]], events=("e2",)),
             out([3], start=6, rows=1, ids=[3]), out([], codes=[[5, 6]], finished=True, events=("e3",))]
    held, tokens = [], []
    for part in parts[:-1]:  # a round each, held after every one
        held = gather_outputs([part], held=held)
        tokens += part.new_token_ids
        assert [(g.request_id, g.new_token_ids, g.finished) for g in held] == [("a", tokens, False)]
    (gathered,) = gather_outputs([parts[-1]], held=held)
    merged = gathered.merged()
    (at_once,) = merge_outputs(parts)
    assert merged.new_token_ids == at_once.new_token_ids == [1, 2, 3] and merged.finished
    assert merged.finish_reason == "stop" and merged.ready_events == ("e1", "e2", "e3") == at_once.ready_events
    assert merged.states_start == 4 and merged.states["input_embeds"][:, 0].tolist() == [4.0, 4.0, 6.0]
    assert merged.extras["codes"].tolist() == [[1, 2], [3, 4], [5, 6]] == at_once.extras["codes"].tolist()
    assert merged.token_ids_device.tolist() == [1, 3] and parts[0].new_token_ids == [1], "no part changed"
    lone = out([7], codes=[[8, 9]])
    assert merge_outputs([lone]) == [lone]


def idle(stats) -> bool:
    return stats.num_running == stats.num_waiting == stats.num_waiting_for_input == 0


def test_engine_loop_merges_what_queued_behind_a_slow_consumer(talker):
    prefill, text = talker_inputs(4, 8, 4)
    params = greedy(10)
    ref_tokens, ref_frames = talker_alone(talker, params, prefill, text)

    loop = EngineLoop(talker_engine(talker)).start()
    try:
        release, stalled, delivered = threading.Event(), threading.Event(), []

        def slow_consumer(output):  # the first call blocks the response thread while the engine runs on
            stalled.set()
            release.wait(10)
            delivered.append(output)

        loop.add_request("a", params, callback=slow_consumer, prompt_embeds=prefill, trailing_text_embeds=text,
                         thinker_finished=True)
        assert stalled.wait(10)
        # the loop's stats are taken after a step's outputs are queued: all zero once the last output is queued
        # (the engine's requests empty out earlier, inside the step, before its outputs reach the queue)
        deadline = time.time() + 30
        while not idle(loop.stats()) and time.time() < deadline:
            time.sleep(0.01)
        release.set()
        while not delivered or not delivered[-1].finished:
            time.sleep(0.01)
    finally:
        loop.shutdown()
    assert_same_as_alone(delivered, ref_tokens, ref_frames)
    # one call for the output being delivered when the consumer stalled, one for everything after it
    assert len(delivered) <= 2 < len(ref_tokens["a"])


def test_engine_loop_batches_a_talkers_frames_as_its_policy_says(talker):
    """Output batching (the served talker's: first response at the first chunk's frames, then 8 a response): the
    same tokens and frames as stepped by hand, in fewer calls, each of the policy's size but the last."""
    from omni_triton.engine.output_batching import OutputBatching

    prefill, text = talker_inputs(4, 8, 4)
    params = greedy(30)
    ref_tokens, ref_frames = talker_alone(talker, params, prefill, text)
    batching = OutputBatching(first_tokens=4, min_tokens=8, max_hold_s=60.0)  # never due by age here
    loop = EngineLoop(talker_engine(talker, output_batching=batching)).start()
    try:
        stream = loop.add_request("a", params, prompt_embeds=prefill, trailing_text_embeds=text,
                                  thinker_finished=True)
        delivered = list(stream)
    finally:
        loop.shutdown()
    assert_same_as_alone(delivered, ref_tokens, ref_frames)
    sizes = [len(output.new_token_ids) for output in delivered]
    assert sizes[0] >= 4 and all(size >= 8 for size in sizes[1:-1]) and len(delivered) < len(ref_tokens["a"]) / 4


def test_engine_loop_delivers_a_held_output_once_its_hold_time_is_up(talker):
    """A request whose next batch never fills (it waits for text) still gets its frames, after the hold time;
    its first frame (``first_tokens`` 1) went at once."""
    from omni_triton.engine.output_batching import OutputBatching

    prefill, text = talker_inputs(4, 8, 4)
    batching = OutputBatching(first_tokens=1, min_tokens=100, max_hold_s=0.05)
    loop = EngineLoop(talker_engine(talker, output_batching=batching)).start()
    try:
        stream = loop.add_request("a", greedy(30), prompt_embeds=prefill, trailing_text_embeds=text[:2])
        deliveries = []
        reader = threading.Thread(target=lambda: deliveries.extend(stream), daemon=True)
        reader.start()
        # the request makes its frames, then waits for text; every frame it made goes out by the hold alone
        # (polled with a generous deadline, not a fixed sleep: a loaded CI machine makes frames slowly)
        deadline = time.monotonic() + 30
        while loop.stats().num_waiting_for_input < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.stats().num_waiting_for_input == 1, "the request should wait for text"
        made_by_engine = len(loop.engine.requests["a"].output_token_ids)  # its step thread is idle now
        while (sum(len(output.new_token_ids) for output in list(deliveries)) < made_by_engine
               and time.monotonic() < deadline):
            time.sleep(0.01)
        before = sum(len(output.new_token_ids) for output in list(deliveries))
        loop.abort("a")
        reader.join(timeout=30)
        assert deliveries and deliveries[-1].finish_reason == "abort"
        # every frame it made went out by the hold, none held back for the abort's last output
        made = sum(len(output.new_token_ids) for output in deliveries)
        assert made >= 2 and before == made, (before, made)
    finally:
        loop.shutdown()


# -- attention fast path ------------------------------------------------------------------------------------
def test_fast_attention_path_matches_reference():
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim = 4, 2, 6, 8
    query_lens, context_lens = [5, 1, 3, 1, 7], [5, 9, 11, 2, 7]  # fresh, decode, chunked, decode, fresh
    num_blocks = 40
    perm = torch.randperm(num_blocks, generator=gen).int()
    tables, slots, used = [], [], 0
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-ctx // block_size)
        table = perm[used:used + n]
        used += n
        tables.append(torch.cat([table, torch.full((5 - n,), -1, dtype=torch.int32)]))
        slots += [int(table[p // block_size]) * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    outs = []
    for use_reference in (True, False):
        cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=torch.Generator().manual_seed(1))
        batch = AttentionBatch(query_lens, context_lens, torch.tensor(slots), torch.stack(tables), [cache],
                               block_size, use_reference=use_reference)
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(sum(query_lens), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
        outs.append(batch.attend(0, q, k, v, scale=0.3))
    torch.testing.assert_close(outs[1], outs[0])


def test_thinker_decode_rows_hand_their_token_ids_to_the_graph(thinker):
    """A decode graph embeds the thinker's tokens itself (ThinkerStage.decode_token_ids / embed_token_ids): the
    ids are the ones embed_inputs embeds, and a row still in its prompt (whose input may be audio) opts out."""
    engine = thinker_engine(thinker)
    engine.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
                       prompt_token_ids=[3, 1, 4])
    engine.step()  # the prompt: its first token sampled
    seq = engine.requests["a"]
    stage = engine.stage
    decode = [(seq, 3, 4)]
    assert stage.decode_token_ids(decode) == [seq.output_token_ids[0]]
    assert torch.equal(stage.embed_token_ids(torch.tensor(stage.decode_token_ids(decode))),
                       stage.embed_inputs(decode))
    assert stage.decode_token_ids([(seq, 2, 3)]) is None
