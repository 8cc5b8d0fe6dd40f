"""Overlapped decode steps (engine/overlap.py) on the CPU path: the same tokens, states and finish reasons as
the synchronous engine, with requests stopping, hitting max_new_tokens, arriving and being aborted while a
step is in flight, under block pressure, on the host sampler's exactness guards, and behind the threaded
loop; nothing leaks. (The CUDA-graph path runs the same engine logic: tests/test_fast_path.py on the GPU.)"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from engine_toy_model import ToyThinker, reference_greedy
from omni_triton.engine import EngineConfig, EngineLoop, LLMEngine, SamplingParams, ThinkerStage
from omni_triton.engine.overlap import StepOverlap

pytestmark = pytest.mark.engine

PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 11, list(range(20, 2, -1)), [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def thinker():
    return ToyThinker().eval()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The toy model's ops are tiny: on a shared 2-core machine a second intra-op thread mostly waits (these
    tests ran ~10x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(model, overlap: bool, **config) -> LLMEngine:
    return LLMEngine(ThinkerStage(model, accept_hidden_layer=2),
                     EngineConfig(**{"block_size": 4, "num_blocks": 256, "overlap_steps": overlap, **config}))


def mixed_params(thinker) -> list[SamplingParams]:
    """Greedy and seeded sampling; one request stops on a token it first reaches late in the steady decode (a
    stop found while the next step is in flight), others at max_new_tokens."""
    ref = reference_greedy(thinker, PROMPTS[0], 30)
    stop_at = next(t for i, t in enumerate(ref) if i >= 10 and t not in ref[:i])
    return [SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(stop_at,)),
            SamplingParams(temperature=0.9, top_k=20, seed=3, max_new_tokens=40),
            SamplingParams(temperature=0.0, max_new_tokens=12),
            SamplingParams(temperature=1.1, top_p=0.8, seed=11, max_new_tokens=2),
            SamplingParams(temperature=0.0, max_new_tokens=1)]


def drive(engine: LLMEngine, requests, events=(), max_steps: int = 500):
    """Steps until idle; ``events``: (call index, "add"|"abort", request id) applied before that call.
    Returns per request: tokens, the states' rows (positions, accept_hidden) and the finish reason."""
    pending = {f"r{i}": (params, prompt) for i, (params, prompt) in enumerate(requests)}
    for request_id in [r for r in pending if not any(e[2] == r and e[1] == "add" for e in events)]:
        params, prompt = pending[request_id]
        engine.add_request(request_id, params, prompt_token_ids=prompt)
    tokens, states, reasons = {}, {}, {}
    for call in range(max_steps):
        for _, kind, request_id in [e for e in events if e[0] == call]:
            if kind == "add":
                params, prompt = pending[request_id]
                engine.add_request(request_id, params, prompt_token_ids=prompt)
            else:
                out = engine.abort(request_id)
                if out is not None:
                    reasons[request_id] = out.finish_reason
        if not engine.has_work() and call > max((e[0] for e in events), default=0):
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.states:
                rows = states.setdefault(out.request_id, [])
                assert out.states_start == sum(len(r) for r in rows), "a state row streamed twice or skipped"
                rows.append(out.states["accept_hidden"])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"engine did not go idle in {max_steps} steps: {engine.stats()}")
    return tokens, {k: torch.cat(v) for k, v in states.items()}, reasons


def assert_no_leaks(engine: LLMEngine):
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_overlapped_steps_give_the_synchronous_tokens_states_and_finishes(thinker):
    requests = list(zip(mixed_params(thinker), PROMPTS))
    runs = {}
    for overlap in (False, True):
        engine = make_engine(thinker, overlap, max_num_batched_tokens=16)
        runs[overlap] = drive(engine, requests)
        assert_no_leaks(engine)
        if overlap:
            assert engine.overlap.launched > 8  # the steady state really overlapped
    (sync_tokens, sync_states, sync_reasons), (tokens, states, reasons) = runs[False], runs[True]
    assert tokens == sync_tokens
    assert reasons == sync_reasons and reasons["r0"] == "stop" and reasons["r1"] == "length"
    assert states.keys() == sync_states.keys()
    for request_id, rows in sync_states.items():
        torch.testing.assert_close(states[request_id], rows, rtol=1e-5, atol=1e-5)
    # and the greedy rows are the model's own greedy tokens
    assert tokens["r2"] == reference_greedy(thinker, PROMPTS[2], 12)
    assert tokens["r0"] == reference_greedy(thinker, PROMPTS[0], 30, stop_token_ids=(tokens["r0"][-1],))


def test_arrivals_and_aborts_while_a_step_is_in_flight(thinker):
    params = [SamplingParams(temperature=0.0, max_new_tokens=25),
              SamplingParams(temperature=0.7, seed=5, max_new_tokens=25),
              SamplingParams(temperature=0.0, max_new_tokens=20),
              SamplingParams(temperature=0.0, max_new_tokens=8)]
    requests = list(zip(params, PROMPTS))
    # r2 arrives during the decode, r1 is aborted, r3 arrives and is aborted again before it decodes much
    events = [(8, "add", "r2"), (12, "abort", "r1"), (15, "add", "r3"), (16, "abort", "r3")]
    sync_engine, engine = make_engine(thinker, False), make_engine(thinker, True)
    sync_tokens, _, sync_reasons = drive(sync_engine, requests, events)
    tokens, _, reasons = drive(engine, requests, events)
    assert engine.overlap.launched > 0
    for request_id in ("r0", "r2"):
        assert tokens[request_id] == sync_tokens[request_id]
        assert reasons[request_id] == sync_reasons[request_id] == "length"
    for request_id in ("r1", "r3"):
        assert reasons[request_id] == "abort"
        full = sync_tokens.get(request_id, [])
        got = tokens.get(request_id, [])
        assert got == full[:len(got)] or full == got[:len(full)]  # the same stream, cut at the abort
    assert_no_leaks(engine)
    assert_no_leaks(sync_engine)


def test_block_pressure_and_preemption_with_overlap(thinker):
    # 18 blocks x 4 slots: running all five preempts; an overlapped step never takes a block it lacks
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (12, 7, 20, 15, 9)]
    requests = list(zip(params, PROMPTS))
    sync_engine = make_engine(thinker, False, num_blocks=18, max_num_batched_tokens=32)
    engine = make_engine(thinker, True, num_blocks=18, max_num_batched_tokens=32)
    sync_tokens, _, _ = drive(sync_engine, requests)
    tokens, _, _ = drive(engine, requests)
    assert engine.scheduler.num_preemptions > 0 and engine.overlap.launched > 0
    assert tokens == sync_tokens
    assert [tokens[f"r{i}"] for i in range(5)] == [reference_greedy(thinker, prompt, p.max_new_tokens)
                                                  for p, prompt in requests]
    assert_no_leaks(engine)


def test_host_sampler_rows_whose_draw_reads_the_unread_token_are_not_overlapped(thinker):
    stop = reference_greedy(thinker, PROMPTS[0], 4)[1]
    # a repetition penalty reads the token history: never ahead; a min_new_tokens ban on stop ids reads the
    # token count: ahead only once it cannot change
    penalised = [(SamplingParams(temperature=0.0, repetition_penalty=1.3, max_new_tokens=10), PROMPTS[0])]
    banned = [(SamplingParams(temperature=0.0, min_new_tokens=6, stop_token_ids=(stop,), max_new_tokens=10),
               PROMPTS[0])]
    for requests, overlapped in ((penalised, False), (banned, True)):
        sync_engine, engine = make_engine(thinker, False), make_engine(thinker, True)
        sync_tokens, _, sync_reasons = drive(sync_engine, requests)
        tokens, _, reasons = drive(engine, requests)
        assert (tokens, reasons) == (sync_tokens, sync_reasons)
        assert (engine.overlap.launched > 0) == overlapped
    assert len(tokens["r0"]) >= 6  # the ban held


def test_overlap_behind_the_threaded_loop(thinker):
    engine = make_engine(thinker, True)
    loop = EngineLoop(engine).start()
    try:
        streams = [loop.add_request(f"r{i}", SamplingParams(temperature=0.0, max_new_tokens=10),
                                    prompt_token_ids=prompt) for i, prompt in enumerate(PROMPTS)]
        results = [[t for out in stream for t in out.new_token_ids] for stream in streams]
    finally:
        loop.shutdown()
    assert results == [reference_greedy(thinker, prompt, 10) for prompt in PROMPTS]
    assert engine.overlap.launched > 0
    assert_no_leaks(engine)


def test_stages_whose_next_input_is_made_on_the_device_overlap(thinker):
    """The thinker (its sampled ids' embeddings) and the talker (its frame's completion + the next text: under the
    decode graphs, or eagerly as here), unless overlapped steps are off."""
    from engine_toy_model import ToyTalker
    from omni_triton.engine import TalkerStage

    talker = ToyTalker().eval()
    stage = TalkerStage(talker, tts_eos_embed=torch.zeros(talker.hidden_size),
                        tts_pad_embed=torch.zeros(talker.hidden_size))
    engine = LLMEngine(stage, EngineConfig(block_size=4, num_blocks=64, overlap_steps=True))
    assert engine.overlap is not None and StepOverlap.supported(engine.runner)
    assert LLMEngine(stage, EngineConfig(block_size=4, num_blocks=64, overlap_steps=False)).overlap is None
    assert make_engine(thinker, True).overlap is not None
    assert make_engine(thinker, False).overlap is None


def test_peeking_the_trailing_text_takes_nothing():
    from omni_triton.engine.stage import TrailingTextQueue

    eos, pad = torch.full((4,), 0.5), torch.full((4,), -0.25)
    queue = TrailingTextQueue(eos, pad)
    rows = torch.randn(3, 4)
    queue.append(rows[:2], finished=False)
    taken = []
    for step in range(6):
        if step == 3:
            queue.append(rows[2:], finished=True)
        peeked = queue.peek_trailing()
        got = queue.next_trailing()
        assert (peeked is None and got is None) or torch.equal(peeked, got)
        taken.append(got)
    assert torch.equal(taken[0], rows[0]) and torch.equal(taken[1], rows[1]) and taken[2] is None
    assert torch.equal(taken[3], rows[2]) and torch.equal(taken[4], eos) and torch.equal(taken[5], pad)
    assert torch.equal(queue.peek_trailing(), pad)


def test_talker_inputs_ahead_are_the_inputs_after_sample_pushes():
    """``TalkerStage.inputs_ahead`` (what an overlapped talker step runs on) equals, row for row and bit for
    bit, the inputs ``after_sample`` then pushes, and is None while some row waits for text."""
    from engine_toy_model import ToyTalker
    from omni_triton.engine import TalkerStage

    talker = ToyTalker().eval()
    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    engine = LLMEngine(stage, EngineConfig(block_size=4, num_blocks=128))
    gen = torch.Generator().manual_seed(0)
    texts = torch.randn(4, hidden, generator=gen)
    engine.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=12),
                       prompt_embeds=torch.randn(7, hidden, generator=gen), trailing_text_embeds=texts[:2])
    engine.add_request("b", SamplingParams(temperature=0.0, max_new_tokens=12),
                       prompt_embeds=torch.randn(5, hidden, generator=gen), thinker_finished=True)
    checks = {"equal": 0, "waiting": 0}
    after_sample = stage.after_sample

    def checked_after_sample(seqs, completed):
        ahead = stage.inputs_ahead(seqs, completed)
        stage._inputs_ahead = None  # after_sample makes its own (else it takes these again: test_step_host_paths)
        ready = [seq.stage_state.trailing.peek_trailing() is not None for seq in seqs]
        counts = [len(seq.stage_state.input_embeds) for seq in seqs]
        extras = after_sample(seqs, completed)
        if ahead is None:
            assert not all(ready)
            checks["waiting"] += 1
        else:
            pushed = torch.stack([seq.stage_state.input_embeds[n] for seq, n in zip(seqs, counts)])
            assert torch.equal(ahead, pushed)
            checks["equal"] += 1
        return extras

    stage.after_sample = checked_after_sample
    for call in range(40):
        if call == 6:
            engine.append("a", trailing_text_embeds=texts[2:], finished=True)
        if not engine.has_work() and call > 6:
            break
        engine.step()
    assert checks["equal"] >= 5 and checks["waiting"] >= 1
    assert_no_leaks(engine)


def test_tracing_turned_on_while_a_step_is_in_flight(thinker, tmp_path):
    """A step launched untraced and finished traced has no step-log shape: it is not logged; the next are."""
    import json

    from omni_triton import trace

    engine = make_engine(thinker, True)
    engine.add_request("r0", SamplingParams(temperature=0.0, max_new_tokens=30), prompt_token_ids=PROMPTS[0])
    try:
        for _ in range(5):
            engine.step()
        assert engine._inflight is not None
        trace.configure(tmp_path)
        calls = 0
        while engine.has_work():
            engine.step()
            calls += 1
    finally:
        trace.configure(None)
    steps = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    steps = [entry for entry in steps if entry.get("record") == "step"]
    assert len(steps) == calls - 1 and all(entry["kind"] == "decode" and entry["rows"] == 1 for entry in steps)
    assert_no_leaks(engine)


# -- EngineConfig.overlap_admit: launched ahead while new rows want to join, which join on the step after --------

def random_scenario(seed: int):
    """Requests (params, prompt) of greedy and seeded sampling, some with stop ids, and events: half of them
    arrive mid-decode, some are aborted later; plus a token budget and pool small enough, for some seeds, to
    chunk prefills (an arrival's prompt in one chunk or several), leave runnable rows out of a step and preempt;
    for half of the seeds prefix caching, over prompts of which half begin with a shared prefix."""
    rng = random.Random(seed)
    requests, events = [], []
    shared = [rng.randrange(64) for _ in range(12)]
    for i in range(rng.randint(5, 8)):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:
            prompt = shared[:rng.randint(4, 12)] + prompt[:rng.randint(0, 8)]
        stop = tuple(rng.sample(range(64), rng.randint(0, 2)))
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 30), stop_token_ids=stop)
        else:
            params = SamplingParams(temperature=rng.uniform(0.7, 1.2), top_k=rng.choice((0, 8, 20)),
                                    top_p=rng.choice((1.0, 0.8)), seed=rng.randrange(1000),
                                    max_new_tokens=rng.randint(1, 30), stop_token_ids=stop)
        requests.append((params, prompt))
        added = rng.randint(1, 40) if i and rng.random() < 0.5 else 0
        if added:
            events.append((added, "add", f"r{i}"))
        if rng.random() < 0.25:
            events.append((added + rng.randint(1, 15), "abort", f"r{i}"))
    config = {"max_num_batched_tokens": rng.choice((3, 8, 16, 64)), "num_blocks": rng.choice((16, 256)),
              "prefix_caching": seed % 2 == 1}
    return requests, sorted(events), config


def test_launching_ahead_of_joining_rows_gives_the_synchronous_tokens(thinker):
    """Randomized interleavings of admissions, aborts, stops and max_new_tokens (and, for some seeds, block
    pressure and a token budget under the running rows): overlapped steps with and without ``overlap_admit``
    give every request the tokens, states and finish of the synchronous engine (an aborted one: the same
    stream, cut where the abort found it), also where steps launch ahead after rows finished their prefill (over
    cached prefixes for some seeds) and without rows that leave (stopped, at max_new_tokens) or, with
    ``overlap_admit``, whose prefill goes on; no block leaks."""
    launched_before_joiners, launched_after_prefills, hits, default_after_prefills, subsets = [], [], [], [], []
    for seed in range(12):
        requests, events, config = random_scenario(seed)
        aborted = {request_id for _, kind, request_id in events if kind == "abort"}
        full_tokens, full_states, full_reasons = drive(make_engine(thinker, False, **config), requests,
                                                       [e for e in events if e[1] == "add"])
        for overlap, admit in ((False, False), (True, False), (True, True)):
            engine = make_engine(thinker, overlap, overlap_admit=admit, **config)
            tokens, states, reasons = drive(engine, requests, events)
            assert_no_leaks(engine)
            assert engine.block_manager.num_used == 0
            assert reasons.keys() == full_reasons.keys()
            for request_id in full_reasons:
                got, case = tokens.get(request_id, []), (seed, request_id, overlap, admit)
                if request_id in aborted and reasons[request_id] == "abort":
                    assert got == full_tokens[request_id][:len(got)], case
                    continue
                assert (got, reasons[request_id]) == (full_tokens[request_id], full_reasons[request_id]), case
                if request_id in full_states:
                    torch.testing.assert_close(states[request_id], full_states[request_id], rtol=1e-5, atol=1e-5)
            if admit:
                launched_before_joiners.append(engine.overlap.launched_before_joiners)
                launched_after_prefills.append(engine.overlap.launched_after_prefills)
                hits.append(engine.block_manager.num_hit_tokens)
            elif overlap:
                default_after_prefills.append(engine.overlap.launched_after_prefills)
            if overlap:
                subsets.append(engine.overlap.launched_subsets)
    # the relaxed paths ran; without overlap_admit too, a step after rows ended their prefill (no request waiting)
    # goes ahead, and steps go ahead without rows that stopped, reached their length or continue a prefill
    assert sum(n > 0 for n in default_after_prefills) >= 6, default_after_prefills
    assert sum(n > 0 for n in subsets) >= 12, subsets
    assert sum(n > 0 for n in launched_before_joiners) >= 8, launched_before_joiners
    assert all(n > 0 for n in launched_after_prefills), launched_after_prefills
    assert sum(n > 0 for n in hits[1::2]) >= 4, hits  # (prefix caching on odd seeds)


def traced_drive(engine: LLMEngine, requests, events, directory):
    """``drive`` with the step log on: also its step records."""
    from omni_triton import trace

    trace.configure(directory)
    try:
        tokens, _, reasons = drive(engine, requests, events)
    finally:
        trace.configure(None)
    return tokens, reasons, trace.read_records(directory, "step")


def joining_scenario(name: str):
    """(requests, events, engine config) of requests that wait for admission while others decode."""
    if name == "budget_full":  # a 3-token budget under three decoding rows: a fourth waits until one finishes
        requests = [(SamplingParams(temperature=0.0, max_new_tokens=n), [5 + n]) for n in (20, 14, 9, 16)]
        return requests, [], {"max_num_batched_tokens": 3}
    requests = [(SamplingParams(temperature=0.0, max_new_tokens=50), PROMPTS[0]),
                (SamplingParams(temperature=0.8, seed=2, max_new_tokens=50), PROMPTS[2])]
    requests += [(SamplingParams(temperature=0.0, max_new_tokens=3), PROMPTS[3 + i % 2]) for i in range(6)]
    events = [(4 + 7 * i, "add", f"r{2 + i}") for i in range(6)]  # mid-decode, each while a step is in flight
    # queue_full: no room for them until the first two finish; chunked: an 8-token budget under two decoding rows
    # prefills the 18-token prompts in three chunks, the 7-token ones in two, with prefix caching on
    return requests, events, {"queue_full": {"max_num_seqs": 2},
                              "chunked": {"max_num_batched_tokens": 8, "prefix_caching": True}}.get(name, {})


@pytest.mark.parametrize("scenario", ["admissions", "chunked", "queue_full", "budget_full"])
def test_joining_rows_wait_one_launched_step_at_most(thinker, tmp_path, scenario):
    """Requests arriving mid-decode (admitted at once, their prompts in one chunk or several, or queued behind a
    full running set), or a request that waits for the token budget: with ``overlap_admit`` the step after the
    one that sees them is launched ahead anyway and they join on the step after it (queued requests that cannot
    be admitted hold nothing back), and the step after the one that ends their prefill is launched ahead too;
    the same tokens, and more steps launched ahead."""
    requests, events, config = joining_scenario(scenario)
    reason = "waiting"
    runs = {}
    for admit in (False, True):
        engine = make_engine(thinker, True, overlap_admit=admit, **config)
        tokens, reasons, records = traced_drive(engine, requests, events, tmp_path / str(admit))
        assert_no_leaks(engine)
        runs[admit] = tokens, reasons, records, engine.overlap.launched_before_joiners
    (tokens, reasons, records, _), (admit_tokens, admit_reasons, admit_records, joiners) = runs[False], runs[True]
    assert (admit_tokens, admit_reasons) == (tokens, reasons)
    assert sum(r["not_ahead"] == reason for r in records) >= 6
    ahead = sum(r["ahead"] for r in records) / len(records)
    admit_ahead = sum(r["ahead"] for r in admit_records) / len(admit_records)
    # admissions: the step after the one that ends a prefill goes ahead (before: synchronous, 60% ahead); chunked:
    # so does the one after a prefill's last chunk, not after a chunk that samples nothing; a queue that cannot be
    # admitted holds no step back; one the budget holds, every other one
    gain = {"admissions": 0.0, "chunked": 0.0, "queue_full": 0.5, "budget_full": 0.1}[scenario]
    assert admit_ahead >= ahead + gain, (ahead, admit_ahead)
    if scenario == "admissions":
        assert admit_ahead > 0.7
    # (chunked: an arrival seen while a prefill goes on joins after it, no step launched before it)
    assert joiners == {"admissions": 6, "chunked": 10, "queue_full": 0, "budget_full": 5}[scenario]
    # a step launched despite joining rows is followed by a scheduled step: it says why it launched nothing
    launched_despite = [i for i, r in enumerate(admit_records[:-1]) if r["not_ahead"] is None
                        and admit_records[i + 1]["not_ahead"] == reason]
    assert len(launched_despite) >= {"admissions": 6, "chunked": 5, "queue_full": 0, "budget_full": 3}[scenario]
    for i in launched_despite:
        assert not admit_records[i + 2]["ahead"]
    # steps with prefill rows (budget_full: none, its prompts are one token): followed ahead where every row
    # sampled (a prefill ended), and where one goes on, without its row (every row: not)
    prefills = [r for r in admit_records if r["kind"] != "decode"]
    for r in prefills:
        if r["sampled"] == r["rows"]:
            assert r["not_ahead"] != "prefill"
        elif r["not_ahead"] is None:
            assert r["left_out"]["prefill"] == r["rows"] - r["sampled"], r
        else:
            assert r["not_ahead"] in ("prefill", "runnable_changed", "waiting"), r
    assert sum(r["not_ahead"] is None for r in prefills) >= {"queue_full": 3, "budget_full": 0}.get(scenario, 5)
    if scenario == "chunked":  # the first 18- and 7-token prompts' chunks before their last (the later ones: cached)
        assert sum(r["sampled"] < r["rows"] and r["not_ahead"] is None for r in prefills) >= 3
        assert sum(r["prefill_tokens"] for r in prefills) < sum(len(prompt) for _, prompt in requests)  # cached


def test_overlap_admit_is_off_unless_the_environment_turns_it_on(thinker, monkeypatch):
    monkeypatch.delenv("OMNI_TRITON_OVERLAP_ADMIT", raising=False)
    assert not EngineConfig().overlap_admit and not make_engine(thinker, True).overlap.admit_ahead
    monkeypatch.setenv("OMNI_TRITON_OVERLAP_ADMIT", "1")
    assert EngineConfig().overlap_admit and make_engine(thinker, True).overlap.admit_ahead
    assert not make_engine(thinker, True, overlap_admit=False).overlap.admit_ahead


# -- steps launched ahead without some of the step's rows (left_out) ----------------------------------------------

def test_rows_reaching_their_length_leave_while_the_others_go_ahead(thinker, tmp_path):
    """Staggered max_new_tokens: each row that reaches its length leaves the step launched ahead of its last
    token (before: no launch at all); the others' tokens and states are the synchronous engine's."""
    requests = [(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_new_tokens=4 + 5 * i), prompt)
                for i, prompt in enumerate(PROMPTS)]
    sync_tokens, sync_states, sync_reasons = drive(make_engine(thinker, False), requests)
    engine = make_engine(thinker, True)
    tokens, reasons, records = traced_drive(engine, requests, [], tmp_path)
    _, states, _ = drive(make_engine(thinker, True), requests)
    assert (tokens, reasons) == (sync_tokens, sync_reasons) and set(reasons.values()) == {"length"}
    for request_id, rows in sync_states.items():
        torch.testing.assert_close(states[request_id], rows, rtol=1e-5, atol=1e-5)
    assert_no_leaks(engine)
    # four rows leave by length while others decode on (the last one's leaving ends the launches)
    assert sum((r["left_out"] or {}).get("length", 0) for r in records) == 4
    assert sum(r["not_ahead"] == "length" for r in records) == 1
    assert engine.overlap.launched_subsets == 4


def talker_engine(talker, overlap: bool, **config) -> LLMEngine:
    from omni_triton.engine import TalkerStage

    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    return LLMEngine(stage, EngineConfig(**{"block_size": 4, "num_blocks": 256, "overlap_steps": overlap, **config}))


def talker_scenario(seed: int):
    """Talker requests (params, prefill embeds, text rows, text rows given at admission) and events: (call,
    "add", id) arrivals mid-decode (prefill rows beside decoding ones), (call, "text", id, n) n more text rows
    (None: the rest, finished), so rows wait for their text now and then."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    requests, events = [], []
    for i in range(rng.randint(3, 6)):
        prefill = torch.randn(rng.randint(1, 14), 32, generator=gen)
        text = torch.randn(rng.randint(0, 12), 32, generator=gen)
        stop = tuple(rng.sample(range(48), rng.randint(0, 2)))
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 24), stop_token_ids=stop)
        else:
            params = SamplingParams(temperature=rng.uniform(0.7, 1.2), top_k=rng.choice((0, 8)), seed=rng.randrange(99),
                                    max_new_tokens=rng.randint(1, 24), stop_token_ids=stop)
        given = rng.randint(0, len(text))
        requests.append((params, prefill, text, given))
        added = rng.randint(1, 20) if i and rng.random() < 0.5 else 0
        if added:
            events.append((added, "add", f"r{i}"))
        call, left = added, len(text) - given
        while left:
            call += rng.randint(1, 6)
            n = rng.randint(1, left)
            events.append((call, "text", f"r{i}", n))
            left -= n
        events.append((call + rng.randint(0, 6), "text", f"r{i}", None))
    config = {"max_num_batched_tokens": rng.choice((4, 16, 64)), "num_blocks": rng.choice((24, 256))}
    return requests, sorted(events, key=lambda e: e[0]), config


def talker_drive(engine: LLMEngine, requests, events, max_steps: int = 600):
    """Steps until idle, applying ``events`` before their call; per request its tokens, codes and finish."""
    sent = {}

    def add(request_id):
        params, prefill, text, given = requests[int(request_id[1:])]
        sent[request_id] = given
        engine.add_request(request_id, params, prompt_embeds=prefill, trailing_text_embeds=text[:given],
                           thinker_finished=given == len(text) and not any(e[2] == request_id and e[1] == "text"
                                                                            for e in events))

    for i in range(len(requests)):
        if not any(e[2] == f"r{i}" and e[1] == "add" for e in events):
            add(f"r{i}")
    tokens, codes, reasons = {}, {}, {}
    last_event = max((e[0] for e in events), default=0)
    for call in range(max_steps):
        for event in [e for e in events if e[0] == call]:
            if event[1] == "add":
                add(event[2])
            elif event[2] in engine.requests:
                request_id, n = event[2], event[3]
                text = requests[int(request_id[1:])][2]
                end = len(text) if n is None else sent[request_id] + n
                engine.append(request_id, trailing_text_embeds=text[sent[request_id]:end], finished=n is None)
                sent[request_id] = end
        if not engine.has_work() and call > last_event:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if "codes" in out.extras:
                codes.setdefault(out.request_id, []).append(out.extras["codes"])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"engine did not go idle in {max_steps} steps: {engine.stats()}")
    return tokens, {k: torch.cat(v) for k, v in codes.items()}, reasons


def test_talker_rows_waiting_for_text_or_in_prefill_stay_out_of_the_step_launched_ahead(tmp_path):
    """Randomized talker mixes (text arriving in pieces, so rows wait for it now and then; arrivals mid-decode,
    their prefill rows beside decoding ones, in one chunk or several; staggered lengths, stops, block pressure):
    overlapped steps, with and without ``overlap_admit``, give every request the synchronous engine's tokens,
    codes and finish. Steps launch ahead without the rows waiting for text or reaching their length, with rows
    whose text came since, and after steps with prefill rows (whose frames are completed at the launch); no block
    leaks."""
    from engine_toy_model import ToyTalker
    from omni_triton import trace

    talker = ToyTalker().eval()
    left_out, after_prefills, joined = {}, 0, 0
    for seed in range(10):
        requests, events, config = talker_scenario(seed)
        sync_tokens, sync_codes, sync_reasons = talker_drive(talker_engine(talker, False, **config), requests, events)
        for admit in (False, True):
            engine = talker_engine(talker, True, overlap_admit=admit, **config)
            directory = tmp_path / f"{seed}-{admit}"
            trace.configure(directory)
            try:
                tokens, codes, reasons = talker_drive(engine, requests, events)
            finally:
                trace.configure(None)
            assert (tokens, reasons) == (sync_tokens, sync_reasons), (seed, admit)
            assert codes.keys() == sync_codes.keys()
            for request_id, rows in sync_codes.items():
                assert torch.equal(codes[request_id], rows), (seed, admit, request_id)
            assert_no_leaks(engine)
            for record in trace.read_records(directory, "step"):
                for reason, n in (record["left_out"] or {}).items():
                    left_out[reason] = left_out.get(reason, 0) + n
            after_prefills += engine.overlap.launched_after_prefills
            joined += engine.overlap.joined
    assert joined >= 10, joined
    assert left_out.get("inputs", 0) >= 10 and left_out.get("length", 0) >= 10, left_out
    assert left_out.get("prefill", 0) >= 5, left_out  # (overlap_admit: a talker prefill chunked beside decode rows)
    assert after_prefills >= 10


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_sampler_controls_on_the_emulated_fast_path_are_the_synchronous_ones(stage, monkeypatch):
    """The serving fast path's host code (device samplers, decode and completion graphs; emulated on the CPU over
    stub models, benchmarks/overlap_ahead_mix.py's mix: staggered lengths, closed-loop arrivals, the talker's text
    arriving in pieces): every draw a row's samplers are prepared for (its stream, draw index, min_new_tokens ban
    on stop ids) is the synchronous engine's, with rows left out of steps launched ahead, steps launched after
    prefill ends (the talker's frames completed at the launch) and, with overlap_admit, rows joining later."""
    from benchmark_scripts import load_script
    from omni_triton import graph_buckets
    from omni_triton.engine.sampling import DeviceSampler

    mix = load_script("overlap_ahead_mix")
    monkeypatch.setattr(DeviceSampler, "sample", DeviceSampler.sample)  # (the emulation replaces them: restored)
    for module in list(sys.modules.values()):
        if getattr(module, "capture_buckets", None) is graph_buckets.capture_buckets and module is not graph_buckets:
            monkeypatch.setattr(module, "capture_buckets", module.capture_buckets)
    prepare = DeviceSampler.prepare
    log: list = []

    def recording_prepare(self, keys, rows, draws, tokens_ahead=0):
        stream = "main" if self.history is not None else "completion"
        for i, (key, row, draw) in enumerate(zip(keys, rows, draws)):
            ahead = tokens_ahead if isinstance(tokens_ahead, int) else tokens_ahead[i]
            log.append((key, stream, draw, row.stop_ids_banned_after(ahead)))
        return prepare(self, keys, rows, draws, tokens_ahead)

    monkeypatch.setattr(DeviceSampler, "prepare", recording_prepare)
    lengths = (2, 40) if stage == "thinker" else (2, 60)
    runs = {}
    for overlap, admit in ((False, False), (True, False), (True, True)):
        log.clear()
        summary = mix.run_mix(stage, 8, 24, lengths, admit, seed=3, overlap=overlap, min_new_tokens=5)
        draws: dict = {}
        for key, stream, draw, banned in log:
            assert draws.setdefault((key, stream, draw), banned) == banned, (key, stream, draw)
        runs[overlap, admit] = draws, summary
    sync, _ = runs[False, False]
    for admit in (False, True):
        draws, summary = runs[True, admit]
        assert summary["ahead_pct"] > 50 and summary["left_out_rows"].get("length", 0) > 5, summary
        if stage == "talker":  # rows waiting for text stay out; when it comes, they join a step launched ahead
            assert summary["left_out_rows"].get("inputs", 0) > 5 and summary["joined_rows"] > 5, summary
        assert {k: v for k, v in draws.items() if k in sync} == sync  # every synchronous draw, the same ban
        # beyond them only completions of a frame after a row's last token (a step with prefill rows completes
        # every sampled row at its launch; the synchronous engine, the rows that go on)
        extra = [k for k in draws if k not in sync]
        assert all(stream == "completion" for _, stream, _ in extra), extra[:5]
        assert len(extra) <= 24
