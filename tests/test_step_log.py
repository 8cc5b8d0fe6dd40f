"""The engines' step log (omni_triton/engine/step_log.py) on the toy engines, and the per-engine breakdown built from
it (omni_triton/bench/step_breakdown.py) on synthetic step records."""

from __future__ import annotations

import gc
import json
import queue
import threading
import time
from collections import Counter

import pytest
import torch

from engine_toy_model import ToyTalker, ToyThinker, reference_greedy
from omni_triton import trace
from omni_triton.bench import breakdown, step_breakdown
from omni_triton.engine import EngineConfig, EngineLoop, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.step_log import GAP_PARTS, BetweenSteps, StepLog, thread_gc_ms

PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 11]
MAX_NEW = [12, 7, 20]
FIELDS = {"record", "t", "pid", "engine", "kind", "rows", "tokens", "prefill_tokens", "decode_rows", "sampled",
          "completion_rows", "graph", "preempted", "waiting", "waiting_input", "left_runnable", "left_waiting_input",
          "ahead", "not_ahead", "left_out", "joined", "host_ms", "gpu_ms", "gap_ms", "cpu_ms", "gc_ms", "gap_cpu_ms",
          "gap_gc_ms", "gap_commands", "gap_commands_by_kind", *(f"gap_{part}_ms" for part in GAP_PARTS)}
# the step thread's times of a step and of the gap before it (ms), from the thread's clocks and the loop's timers
TIMES = ("cpu_ms", "gc_ms", "gap_cpu_ms", "gap_gc_ms", *(f"gap_{part}_ms" for part in GAP_PARTS))


def test_thinker_steps_are_logged_and_add_up_to_what_was_generated(traced):
    engine = LLMEngine(ThinkerStage(ToyThinker().eval()),
                       EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=16))
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        engine.add_request(f"r{i}", SamplingParams(temperature=0.0, max_new_tokens=n), prompt_token_ids=prompt)
    generated = steps = 0
    while engine.has_work():
        generated += sum(len(out.new_token_ids) for out in engine.step())
        steps += 1
    records = trace.read_records(traced, "step")
    assert len(records) == steps and all(set(r) == FIELDS for r in records)
    assert {r["engine"] for r in records} == {"thinker"}
    assert sum(r["sampled"] for r in records) == generated == sum(MAX_NEW)
    # every prompt position, and every generated token but the last, is computed once (no preemption here)
    assert sum(r["tokens"] for r in records) == sum(map(len, PROMPTS)) + sum(MAX_NEW) - len(PROMPTS)
    assert {r["kind"] for r in records} == {"prefill", "mixed", "decode"}  # a 16-token budget chunks the prefills
    assert all(r["tokens"] <= 16 and r["prefill_tokens"] + r["decode_rows"] == r["tokens"] for r in records)
    assert all(r["gpu_ms"] is None and r["host_ms"] > 0 and r["completion_rows"] == 0 for r in records)
    assert records[0]["gap_ms"] is None and all(r["gap_ms"] >= 0 for r in records[1:])
    assert records[-1]["left_runnable"] == 0
    # stepped by hand: no loop applied commands between the steps; the thread's clocks ran
    assert all(r["gap_commands"] == 0 and r["gap_commands_by_kind"] == {} and r["gap_commands_ms"] == 0
               for r in records)
    assert records[0]["gap_cpu_ms"] is None and records[0]["gap_gc_ms"] is None
    assert all(r[time] >= 0 for r in records[1:] for time in TIMES) and all(r["cpu_ms"] >= 0 for r in records)


def test_engine_loop_logs_what_it_did_between_steps(traced):
    """EngineLoop times each gap between steps into the next step's record (step_log.BetweenSteps): every command
    it applied is counted once, by kind (appends for a finished request and aborts of unknown ones too: the loop
    applied them), and the gap's times are known."""
    talker = ToyTalker().eval()
    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    loop = EngineLoop(LLMEngine(stage, EngineConfig(block_size=4, num_blocks=128))).start()
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(6, hidden, generator=gen)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    try:
        first = loop.add_request("a", params, prompt_embeds=torch.randn(5, hidden, generator=gen),
                                 trailing_text_embeds=text[:1])
        for row in text[1:]:  # the thinker's text, a row at a time
            loop.append("a", trailing_text_embeds=row[None])
        loop.append("a", finished=True)
        loop.abort("unknown")
        # its prefill is a step after every command above: each one lies in a logged gap
        last = loop.add_request("b", params, prompt_embeds=torch.randn(4, hidden, generator=gen),
                                thinker_finished=True)
        assert list(first)[-1].finished and list(last)[-1].finished
    finally:
        loop.shutdown()
    records = trace.read_records(traced, "step")
    assert records and all(set(r) == FIELDS for r in records)
    by_kind = Counter()
    for r in records:
        assert all(n > 0 for n in r["gap_commands_by_kind"].values())  # (kinds applied only)
        assert r["gap_commands"] == sum(r["gap_commands_by_kind"].values())
        by_kind.update(r["gap_commands_by_kind"])
    assert by_kind == {"add": 2, "append": 6, "abort": 1}
    assert records[0]["gap_commands_by_kind"]["add"] >= 1  # a's add (at least), before the first step
    assert all(isinstance(r[time], float) and r[time] >= 0 for r in records[1:] for time in TIMES)
    assert sum(r["gap_commands_ms"] for r in records) > 0


def test_engine_loop_traces_each_request_s_first_response_once(traced):
    """``<engine>.first_response``: the response thread hands a request's first tokens to its callback, once per
    request (the breakdown's split between a stage's own first chunk and the hand-off after it), after its
    first token, before the consumer has them."""
    loop = EngineLoop(LLMEngine(ThinkerStage(ToyThinker().eval()), EngineConfig(block_size=4, num_blocks=256))).start()
    received: dict[str, float] = {}
    try:
        streams = {f"r{i}": loop.add_request(f"r{i}", SamplingParams(temperature=0.0, max_new_tokens=n),
                                             prompt_token_ids=prompt)
                   for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW))}
        for request_id, stream in streams.items():
            for output in stream:
                if output.new_token_ids and request_id not in received:
                    received[request_id] = time.monotonic()
    finally:
        loop.shutdown()
    lines = [json.loads(line) for path in traced.glob("*.jsonl") for line in path.read_text().splitlines()]
    firsts = Counter(line["id"] for line in lines if line.get("event") == "thinker.first_response")
    assert firsts == dict.fromkeys(streams, 1)
    events = trace.read_events(traced)
    for request_id in streams:
        assert events[request_id]["thinker.first_token"] <= events[request_id]["thinker.first_response"]
        assert events[request_id]["thinker.first_response"] <= received[request_id]


def test_between_steps_times_parts_and_counts_commands():
    between = BetweenSteps()
    assert between.command("append", lambda x: x + 1, 1) == 2
    between.command("append", lambda: None)
    between.command("add", lambda: None)
    with pytest.raises(queue.Empty):  # a wait for a command that timed out is timed all the same
        between.time("blocked", queue.SimpleQueue().get, True, 0.001)
    fields = between.fields()
    assert fields["gap_commands"] == 3 and fields["gap_commands_by_kind"] == {"append": 2, "add": 1}
    assert fields["gap_blocked_ms"] > 0 and fields["gap_stats_ms"] == 0
    assert set(fields) == {"gap_commands", "gap_commands_by_kind", *(f"gap_{part}_ms" for part in GAP_PARTS)}
    between.reset()
    assert sum(between.ms.values()) == 0 and between.fields()["gap_commands_by_kind"] == {}
    # a step's end starts the next gap in the same object: the loop holds it across the step
    log = StepLog("talker", torch.device("cpu"))
    between = log.between
    between.command("append", lambda: None)
    log.end(log.begin())
    assert log.between is between and between.fields()["gap_commands"] == 0
    # the breakdown names every part the loop times
    assert set(step_breakdown.GAP_PARTS) == set(GAP_PARTS)


def test_garbage_collection_is_timed_on_the_thread_that_ran_it():
    thread_gc_ms()  # (installs the clock)
    gc.disable()  # (no automatic collection in between: only the two below)
    try:
        before = thread_gc_ms()
        other = threading.Thread(target=gc.collect)
        other.start()
        other.join()
        assert thread_gc_ms() == before
        gc.collect()
        assert thread_gc_ms() > before
    finally:
        gc.enable()


def test_steps_say_whether_they_were_launched_ahead_and_why_not(traced):
    """The thinker on one stream overlaps its decode steps (engine/overlap.py): steps launched by the step before
    say ``ahead``; the others say why not: an admission queued mid-decode ("waiting"), the last row's last token.
    A step whose rows all sampled, a prefill ending, is followed ahead; a row that stopped is left out of the step
    launched after the one that read its stop (``left_out``)."""
    model = ToyThinker().eval()
    engine = LLMEngine(ThinkerStage(model), EngineConfig(block_size=4, num_blocks=256))
    assert engine.overlap is not None
    engine.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=30), prompt_token_ids=PROMPTS[1])
    for _ in range(8):
        engine.step()
    greedy = reference_greedy(model, PROMPTS[0], 6)
    stop = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    engine.add_request("b", SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)),
                       prompt_token_ids=PROMPTS[0])
    while engine.has_work():
        engine.step()
    records = trace.read_records(traced, "step")
    # a step is ahead exactly when the one before launched it
    assert [r["ahead"] for r in records] == [False] + [r["not_ahead"] is None for r in records[:-1]]
    # a's prefill (its first token sampled) is followed ahead: a's decode is ahead from its first step
    assert records[0]["kind"] == "prefill" and records[0]["not_ahead"] is None and all(r["ahead"] for r in records[1:9])
    # the 9th step was launched before b arrived, and could not launch its successor with b queued
    assert records[8]["not_ahead"] == "waiting"
    assert records[9]["kind"] == "mixed" and records[9]["not_ahead"] is None  # b's prompt in one chunk: it sampled
    assert records[10]["ahead"] and records[10]["kind"] == "decode" and records[10]["rows"] == 2
    # b's stop is read while the step after it is in flight: the step launched next leaves b out
    left = [i for i, r in enumerate(records) if r["left_out"]]
    assert len(left) == 1 and records[left[0]]["left_out"] == {"stopped": 1}
    assert records[left[0]]["rows"] == 2 and records[left[0] + 1]["rows"] == 1 and records[left[0] + 1]["ahead"]
    assert not any(r["not_ahead"] == "stopped" for r in records) and not any(r["joined"] for r in records)
    assert records[-1]["not_ahead"] == "length"
    assert sum(r["ahead"] for r in records) == len(records) - 2


def test_steps_without_overlap_say_so(traced):
    engine = LLMEngine(ThinkerStage(ToyThinker().eval()),
                       EngineConfig(block_size=4, num_blocks=64, overlap_steps=False))
    talker = ToyTalker().eval()
    hidden = talker.hidden_size

    # a talker stage whose next inputs cannot be made on the device (named as the talker's: the engine's name)
    no_inputs_ahead = type("TalkerStage", (TalkerStage,), {"inputs_ahead": None})
    stage = no_inputs_ahead(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    talker_engine = LLMEngine(stage, EngineConfig(block_size=4, num_blocks=64))
    engine.add_request("r", SamplingParams(temperature=0.0, max_new_tokens=4), prompt_token_ids=[1, 2])
    talker_engine.add_request("t", SamplingParams(temperature=0.0, max_new_tokens=4),
                              prompt_embeds=torch.randn(5, hidden), thinker_finished=True)
    while engine.has_work() or talker_engine.has_work():
        engine.step()
        talker_engine.step()
    records = trace.read_records(traced, "step")
    assert {(r["engine"], r["ahead"], r["not_ahead"]) for r in records} == {("thinker", False, "off"),
                                                                           ("talker", False, "not_supported")}


def test_tracing_off_logs_no_step(tmp_path):
    trace.configure(None)
    engine = LLMEngine(ThinkerStage(ToyThinker().eval()), EngineConfig(block_size=4, num_blocks=64))
    engine.add_request("r", SamplingParams(temperature=0.0, max_new_tokens=3), prompt_token_ids=[1, 2])
    while engine.has_work():
        engine.step()
    assert not list(tmp_path.rglob("*.jsonl"))


def test_talker_rows_waiting_for_input_are_counted(traced):
    talker = ToyTalker().eval()
    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    engine = LLMEngine(stage, EngineConfig(block_size=4, num_blocks=128))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine.add_request("a", params, prompt_embeds=torch.randn(9, hidden, generator=gen),
                       trailing_text_embeds=torch.randn(2, hidden, generator=gen))  # then waits for more text
    engine.add_request("b", params, prompt_embeds=torch.randn(12, hidden, generator=gen),
                       trailing_text_embeds=torch.randn(3, hidden, generator=gen), thinker_finished=True)
    for _ in range(6):
        engine.step()
    records = trace.read_records(traced, "step")
    # step 1: both prefills; 2-3: a eats its two text rows; from then on a waits and b decodes alone (the 4th
    # step launched ahead, before the 3rd's finish left a waiting: its queues are its launch's)
    assert [r["rows"] for r in records] == [2, 2, 2, 1, 1, 1]
    assert [r["waiting_input"] for r in records] == [0, 0, 0, 0, 1, 1]
    assert [r["left_waiting_input"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert all(r["completion_rows"] == r["sampled"] for r in records)  # the code predictor ran on every frame
    engine.append("a", trailing_text_embeds=torch.randn(1, hidden, generator=gen), finished=True)
    engine.step()  # (launched ahead while a waited) a joins the step it launches
    engine.step()
    records = trace.read_records(traced, "step")
    assert records[-2]["joined"] == 1 and records[-1]["rows"] == 2 and records[-1]["waiting_input"] == 0


def step(engine, t_end, host_ms, gpu_ms=None, kind="decode", rows=4, waiting_input=0, left_runnable=1,
         left_waiting_input=0, pid=1, **fields):
    return dict(record="step", engine=engine, t=t_end, pid=pid, host_ms=host_ms, gpu_ms=gpu_ms, kind=kind,
                rows=rows, decode_rows=rows if kind != "prefill" else 0, waiting_input=waiting_input,
                left_runnable=left_runnable, left_waiting_input=left_waiting_input, **fields)


def timed(cpu_ms, gc_ms=0.0, gap_ms=None, gap_cpu_ms=None, gap_gc_ms=None, by_kind=None, commands=0.0, stats=0.0,
          outputs=0.0, blocked=0.0, log=0.0):
    """A step record's timing fields (step_log.py)."""
    by_kind = by_kind or {}
    return dict(cpu_ms=cpu_ms, gc_ms=gc_ms, gap_ms=gap_ms, gap_cpu_ms=gap_cpu_ms, gap_gc_ms=gap_gc_ms,
                gap_commands=sum(by_kind.values()), gap_commands_by_kind=by_kind, gap_commands_ms=commands,
                gap_stats_ms=stats, gap_outputs_ms=outputs, gap_blocked_ms=blocked, gap_log_ms=log)


def test_shares_cut_the_window_into_gpu_host_input_and_idle():
    # window 0..1 s. talker: idle 0-0.1, steps 0.1-0.3 (GPU 150 ms of 200), loop gap 0.3-0.35, step 0.35-0.45
    # (GPU 60) leaving rows waiting for input until 0.8, step 0.8-0.9 (mixed, no GPU time: the CPU), then idle
    steps = [step("talker", 0.3, 200, 150), step("talker", 0.45, 100, 60, left_runnable=0, left_waiting_input=2),
             step("talker", 0.9, 100, None, kind="mixed", waiting_input=2, left_runnable=0)]
    shares = step_breakdown.engine_shares(steps, 0.0, 1.0)["talker"]
    assert shares["gpu_pct"] == pytest.approx(21)
    assert shares["host_pct"] == pytest.approx(5 + 4 + 5 + 10)
    assert shares["input_pct"] == pytest.approx(35)
    assert shares["idle_pct"] == pytest.approx(10 + 10)
    assert sum(shares[f"{s}_pct"] for s in step_breakdown.SHARES) == pytest.approx(100)
    assert shares["steps"] == 3 and shares["decode_step_p50_ms"] == pytest.approx(150)
    assert shares["prefill_stall_ms"] == pytest.approx(0)  # the mixed step (100 ms) was not slower than decode
    assert shares["waiting_input_mean"] == pytest.approx(2 / 3)


def test_prefill_stalls_and_windows_clip_steps_of_other_levels():
    steps = [step("thinker", 1.01, 10), step("thinker", 1.02, 10), step("thinker", 1.07, 50, kind="mixed"),
             step("thinker", 5.0, 10), step("thinker", 0.5, 10)]  # the last two belong to other levels
    shares = step_breakdown.engine_shares(steps, 1.0, 1.1)["thinker"]
    assert shares["steps"] == 3 and shares["mixed_steps"] == 1
    assert shares["prefill_stall_ms"] == pytest.approx(40)
    assert step_breakdown.engine_shares(steps, 10.0, 11.0) == {}


def test_two_processes_of_one_engine_are_averaged():
    steps = [step("talker", 0.5, 500, 500, pid=1), step("talker", 0.5, 500, 0.0, pid=2, left_runnable=0)]
    shares = step_breakdown.engine_shares(steps, 0.0, 1.0)["talker"]
    assert shares["gpu_pct"] == pytest.approx(25) and shares["host_pct"] == pytest.approx(25 + 25)
    assert shares["idle_pct"] == pytest.approx(25)


def test_breakdown_table_gets_engine_rows_per_level(tmp_path):
    level, server = tmp_path / "server-c8", tmp_path / "server"
    trace.configure(level)
    trace.event("req", "client.sent")
    trace.configure(server)
    trace.event("req#1", "session.start")
    trace.record("step", 1e9, **{k: v for k, v in step("talker", 0, 1.0).items() if k not in ("record", "t")})
    trace.configure(level)
    trace.event("req", "client.finished")
    trace.configure(None)
    row = breakdown.level_row("server", 8, level, server)
    assert row["engines"] == {}  # the step lies outside the level's window
    steps = [step("talker", 0.3, 200, 150), step("thinker", 0.2, 100, 50, rows=2)]
    row = {**row, "engines": step_breakdown.engine_shares(steps, 0.0, 1.0)}
    table = breakdown.markdown([row, {**row, "concurrency": 32}])
    assert "| talker steps: GPU % of wall | 15 | 15 |" in table
    assert "| thinker steps: decode batch (mean rows) | 2.0 | 2.0 |" in table


def test_share_of_steps_launched_ahead_and_the_commonest_reasons():
    reasons = [None, None, "waiting", None, "inputs", "waiting", None, "prefill", "waiting", None]
    steps = [dict(step("talker", 0.01 * (i + 1), 5), ahead=i > 0 and reasons[i - 1] is None, not_ahead=reason)
             for i, reason in enumerate(reasons)]
    shares = step_breakdown.engine_shares(steps, 0.0, 1.0)["talker"]
    assert shares["ahead_pct"] == pytest.approx(40)  # steps 2, 3, 5, 8 of 10 followed a launch
    assert shares["not_ahead_top"] == "waiting 30%, inputs 10%, prefill 10%"
    row = {"concurrency": 64, "engines": {"talker": shares}}
    lines = step_breakdown.markdown_rows([row])
    assert "| talker steps: steps launched ahead % | 40 |" in lines
    assert "| talker steps: not ahead: top reasons | waiting 30%, inputs 10%, prefill 10% |" in lines
    # step records from before the step log said so: no such rows
    old = step_breakdown.engine_shares([step("talker", 0.01, 5)], 0.0, 1.0)
    assert old["talker"]["ahead_pct"] is None
    assert not [line for line in step_breakdown.markdown_rows([{"engines": old}]) if "ahead" in line]


def test_time_between_steps_while_rows_were_runnable_is_split_by_what_the_loop_did():
    # window 0..1 s: steps 0-0.1, 0.2-0.3 (after a 100 ms gap, rows runnable), 0.5-0.6 (after waiting for input:
    # not a runnable gap), 0.65-0.8 (after a 50 ms gap), then rows runnable until the window's end
    steps = [step("talker", 0.1, 100, **timed(80)),
             step("talker", 0.3, 100, left_runnable=0, left_waiting_input=1,
                  **timed(60, gc_ms=1.0, gap_ms=100, gap_cpu_ms=40, gap_gc_ms=2, by_kind={"append": 2, "add": 1},
                          commands=30, stats=10, outputs=5, log=5)),
             step("talker", 0.6, 100, **timed(50, gap_ms=200, gap_cpu_ms=1, gap_gc_ms=0, by_kind={"append": 1},
                                               commands=50, blocked=150)),
             step("talker", 0.8, 150, **timed(100, gap_ms=50, gap_cpu_ms=20, gap_gc_ms=0, by_kind={"abort": 1},
                                               commands=10, outputs=5, blocked=20, log=5))]
    shares = step_breakdown.engine_shares(steps, 0.0, 1.0)["talker"]
    assert shares["between_pct"] == pytest.approx(10 + 5 + 20)
    assert shares["host_pct"] == pytest.approx(shares["between_pct"] + 45)  # (no GPU time: the steps are host)
    assert (shares["between_p50_ms"], shares["between_p95_ms"]) == (pytest.approx(75), pytest.approx(97.5))
    assert shares["cpu_in_steps_pct"] == pytest.approx(100 * 290 / 450)
    assert shares["cpu_between_pct"] == pytest.approx(100 * 60 / 150)
    assert shares["off_cpu_pct"] == pytest.approx(6 + 1)  # 100 - 40 ms, and 50 - 20 blocked - 20 on the CPU
    assert shares["gc_in_steps_pct"] == pytest.approx(100 * 1 / 450)
    assert shares["gc_between_pct"] == pytest.approx(100 * 2 / 150)
    assert shares["commands_pct"] == pytest.approx(4)
    assert shares["commands_per_gap"] == pytest.approx(2)
    assert shares["commands_by_kind"] == "append 1.0, add 0.5, abort 0.5"
    assert shares["gap_parts"] == "stats snapshots 1.0, queueing outputs 1.0, blocked 2.0, step log 1.0, rest 6.0"
    assert shares["add_gap_commands_p50_ms"] == pytest.approx(30)  # the one gap with an add (and its 2 appends)
    assert shares["append_commands_p50_ms"] is None  # the appends-only gap followed rows waiting for input
    lines = step_breakdown.markdown_rows([{"engines": {"talker": shares}}])
    for line in ("| talker steps: host: between steps, rows runnable % of wall | 35 |",
                 "| talker steps: between steps, rows runnable p50 / p95 (ms) | 75.0 / 97.5 |",
                 "| talker steps: step thread CPU % of its wall (in steps / between steps) | 64 / 40 |",
                 "| talker steps: between steps: applying commands % of wall | 4.0 |",
                 "| talker steps: between steps: commands per gap (mean) | 2.0 |",
                 "| talker steps: between steps: commands per gap by kind (mean) | append 1.0, add 0.5, abort 0.5 |",
                 "| talker steps: between steps: other parts % of wall | stats snapshots 1.0, queueing outputs 1.0, "
                 "blocked 2.0, step log 1.0, rest 6.0 |",
                 "| talker steps: between steps: off the CPU, not blocked (the GIL, preempted) % of wall | 7.0 |",
                 "| talker steps: between steps: a gap with one add: applying its commands p50 (ms) | 30.0 |",
                 "| talker steps: step thread garbage collection % of its wall (in steps / between steps) | 0.2 / 1.3 |"):
        assert line in lines


def test_what_one_admission_and_one_append_cost_the_loop():
    # runnable gaps: one add with 3 appends (14 ms), two adds (counted in neither), appends only (4 in 2 ms, 1 in
    # 0.9 ms, 2 in 1 ms), an abort alone
    gaps = [({"add": 1, "append": 3}, 14.0), ({"add": 2}, 30.0), ({"append": 4}, 2.0), ({"append": 1}, 0.9),
            ({"append": 2}, 1.0), ({"abort": 1}, 0.2)]
    steps = [step("talker", 0.01, 5, **timed(4))] + [
        step("talker", 0.02 * (i + 1), 5, **timed(4, gap_ms=10, gap_cpu_ms=5, by_kind=by_kind, commands=ms))
        for i, (by_kind, ms) in enumerate(gaps)]
    shares = step_breakdown.engine_shares(steps, 0.0, 1.0)["talker"]
    assert shares["add_gap_commands_p50_ms"] == pytest.approx(14)
    assert shares["append_commands_p50_ms"] == pytest.approx(0.5)  # of 0.5, 0.9, 0.5 ms per append
    lines = step_breakdown.markdown_rows([{"engines": {"talker": shares}}])
    assert "| talker steps: between steps: gaps of appends only: applying one p50 (ms) | 0.50 |" in lines


def test_records_from_before_the_gaps_were_timed_show_no_such_rows():
    old = [step("talker", 0.1, 100), step("talker", 0.3, 100), step("talker", 0.5, 100, left_runnable=0)]
    old[1]["gap_ms"], old[2]["gap_ms"] = 100.0, 100.0
    shares = step_breakdown.engine_shares(old, 0.0, 1.0)["talker"]
    assert shares["between_pct"] == pytest.approx(20) and shares["between_p50_ms"] == pytest.approx(100)
    assert all(shares[key] is None for key in ("cpu_in_steps_pct", "cpu_between_pct", "gc_in_steps_pct",
                                               "commands_pct", "commands_per_gap", "commands_by_kind", "gap_parts",
                                               "off_cpu_pct"))
    lines = step_breakdown.markdown_rows([{"engines": {"talker": shares}}, {"engines": {}}])
    assert "| talker steps: between steps, rows runnable p50 / p95 (ms) | 100.0 / 100.0 |  |" in lines
    assert not [line for line in lines if "CPU" in line or "commands" in line or "garbage" in line]
    # records without gap_ms at all (the oldest): no gaps, no crash
    assert step_breakdown.engine_shares([step("talker", 0.1, 100), step("talker", 0.3, 100)],
                                        0.0, 1.0)["talker"]["between_p50_ms"] is None
