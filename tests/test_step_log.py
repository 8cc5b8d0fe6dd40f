"""The engines' step log (omni_triton/engine/step_log.py) on the toy engines, and the per-engine breakdown built from
it (omni_triton/bench/step_breakdown.py) on synthetic step records."""

from __future__ import annotations

import pytest
import torch

from engine_toy_model import ToyTalker, ToyThinker, reference_greedy
from omni_triton import trace
from omni_triton.bench import breakdown, step_breakdown
from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage

PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 11]
MAX_NEW = [12, 7, 20]
FIELDS = {"record", "t", "pid", "engine", "kind", "rows", "tokens", "prefill_tokens", "decode_rows", "sampled",
          "completion_rows", "graph", "preempted", "waiting", "waiting_input", "left_runnable", "left_waiting_input",
          "ahead", "not_ahead", "left_out", "joined", "host_ms", "gpu_ms", "gap_ms"}


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
         left_waiting_input=0, pid=1):
    return dict(record="step", engine=engine, t=t_end, pid=pid, host_ms=host_ms, gpu_ms=gpu_ms, kind=kind,
                rows=rows, decode_rows=rows if kind != "prefill" else 0, waiting_input=waiting_input,
                left_runnable=left_runnable, left_waiting_input=left_waiting_input)


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
