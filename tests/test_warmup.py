"""Warm start (omni_triton/engine/warmup.py, omni_triton/pipeline/code2wav/warmup.py): what a warm-up runs, that
it leaves every engine idle and changes no output, and that a served warm start reports its progress."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine_toy_model import ToyTalker, ToyThinker
from omni_triton import trace
from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.warmup import WarmupPlan, warm_up
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.pipeline.code2wav.warmup import stream_call_frames, warm_up_vocoder, warmup_calls
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from server_fixture import rendered_settings

PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 11]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=12),
          SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=5, max_new_tokens=9),
          SamplingParams(temperature=1.0, seed=7, max_new_tokens=15)]
TOY_CONFIG = dict(block_size=4, num_blocks=96, max_num_batched_tokens=32, max_num_seqs=8)


def test_plan_covers_the_step_budget_and_every_decode_bucket():
    engine = LLMEngine(ThinkerStage(ToyThinker().eval()), EngineConfig(block_size=16, num_blocks=4096,
                                                                         max_num_batched_tokens=512, max_num_seqs=64))
    plan = WarmupPlan.for_engine(engine)
    assert plan.max_batch == 64 and plan.buckets == [1, 2, 4, 8, 16, 32, 48, 64]
    assert {1, 3, 16, 19, 64, 67, 256, 512, 515} <= set(plan.prefill_tokens)  # 515: a chunk over cached context
    assert max(plan.prefill_tokens) == 515
    small = LLMEngine(ThinkerStage(ToyThinker().eval()), EngineConfig(block_size=4, num_blocks=8,
                                                                       max_num_batched_tokens=512))
    assert max(WarmupPlan.for_engine(small).prefill_tokens) <= 32 - 3  # what fits the cache next to its tokens


def thinker_outputs(engine: LLMEngine) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", params, prompt_token_ids=prompt)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_thinker_warm_up_runs_every_step_kind_and_leaves_the_engine_as_new(tmp_path):
    model = ToyThinker().eval()
    fresh = thinker_outputs(LLMEngine(ThinkerStage(model), EngineConfig(**TOY_CONFIG)))
    engine = LLMEngine(ThinkerStage(model), EngineConfig(**TOY_CONFIG))
    lines = []
    trace.configure(tmp_path / "trace")
    try:
        warm_up(engine, log=lines.append)
    finally:
        trace.configure(None)
    plan = WarmupPlan.for_engine(engine)
    assert len(lines) == len(plan) + 1 and all(line.startswith("thinker: warm-up ") for line in lines)
    assert not engine.requests and engine.block_manager.num_used == 0 and engine.stats().num_preemptions == 0
    steps = trace.read_records(tmp_path / "trace", "step")
    assert {step["kind"] for step in steps} == {"prefill", "mixed", "decode"}
    assert max(step["tokens"] for step in steps) == TOY_CONFIG["max_num_batched_tokens"]
    max_batch = TOY_CONFIG["max_num_seqs"]
    mixed = {step["decode_rows"] for step in steps if step["kind"] == "mixed"}
    decode = {step["rows"] for step in steps if step["kind"] == "decode"}
    assert mixed == set(range(1, max_batch)) and decode == set(range(1, max_batch + 1))
    assert thinker_outputs(engine) == fresh


def talker_outputs(engine: LLMEngine) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    for i, params in enumerate(PARAMS):
        engine.add_request(f"r{i}", params, prompt_embeds=torch.randn(5 + 3 * i, 32, generator=gen),
                           trailing_text_embeds=torch.randn(4, 32, generator=gen), thinker_finished=True)
    tokens, frames = {}, {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if "codes" in out.extras:
                frames.setdefault(out.request_id, []).append(out.extras["codes"])
    return tokens, {request_id: torch.cat(rows) for request_id, rows in frames.items()}


def talker_engine(model) -> LLMEngine:
    stage = TalkerStage(model, tts_eos_embed=torch.full((32,), 0.5), tts_pad_embed=torch.full((32,), -0.25))
    return LLMEngine(stage, EngineConfig(**TOY_CONFIG))


def test_talker_warm_up_never_waits_for_input_and_changes_no_frame():
    model = ToyTalker().eval()
    fresh_tokens, fresh_frames = talker_outputs(talker_engine(model))
    engine = talker_engine(model)
    warm_up(engine, log=lambda line: None)  # would never return if a dummy request waited for text
    assert not engine.requests and engine.block_manager.num_used == 0
    tokens, frames = talker_outputs(engine)
    assert tokens == fresh_tokens
    for request_id, codes in fresh_frames.items():
        torch.testing.assert_close(frames[request_id], codes, rtol=0, atol=0)


def test_talker_warm_up_runs_on_fp8_weights(tiny_checkpoint):
    """The FP8 talker's first parameters are float8 weights; its warm-up requests are rows of its embedding's dtype
    (they were float8 once, and the first step failed to stack them with bf16 frames: the H100 FP8 serve refused)."""
    from omni_triton.models.weights import load_talker

    # FP8 everywhere: served, the talker stays bf16 (models.quantization.served_in_fp8); benchmarks still build it FP8
    talker = load_talker(tiny_checkpoint, "cpu", torch.bfloat16, quantization="fp8",
                         fp8_everywhere=True).eval().requires_grad_(False)
    assert next(talker.parameters()).dtype == torch.float8_e4m3fn
    engine = LLMEngine(TalkerStage(talker), EngineConfig(device="cpu", **TOY_CONFIG))
    assert engine.stage.warmup_inputs(3)["prompt_embeds"].dtype == torch.bfloat16
    warm_up(engine, log=lambda line: None)
    assert not engine.requests and engine.block_manager.num_used == 0


def test_warm_up_refuses_a_busy_engine():
    engine = LLMEngine(ThinkerStage(ToyThinker().eval()), EngineConfig(**TOY_CONFIG))
    engine.add_request("r", PARAMS[0], prompt_token_ids=[1, 2])
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)


# ---------------------------------------------------------------- code2wav

def test_vocoder_calls_cover_every_length_of_a_short_context_and_the_ramp_of_a_long_one():
    policy = ChunkPolicy(first_chunk_frames=4, chunk_frames=25, left_context_frames=25)
    assert stream_call_frames(policy) == [4, 12, 36, 50]  # 4 | 8 new + 4 context | 24 + 12 | 25 + 25
    shapes = warmup_calls(policy, 8, replayed=lambda shape: shape[2] <= 32, num_quantizers=16)
    assert shapes == [(b, 16, frames) for frames in range(33, 51) for b in range(1, 9)]  # graphs: up to 32
    long_context = ChunkPolicy(first_chunk_frames=4, chunk_frames=25, left_context_frames=100)
    assert stream_call_frames(long_context) == [4, 12, 36, 61, 86, 111, 125]
    shapes = warmup_calls(long_context, 2, replayed=lambda shape: shape[2] <= 32, num_quantizers=16)
    assert shapes == [(b, 16, frames) for frames in (36, 61, 86, 111, 125) for b in (1, 2)]
    with pytest.raises(ValueError, match="resolve"):
        stream_call_frames(ChunkPolicy())


def test_vocoder_warm_up_runs_on_the_cpu_runtime(tiny_checkpoint):
    from omni_triton.models.code2wav.runtime import Code2WavRuntime

    vocoder = Code2WavRuntime.create("torch", tiny_checkpoint)
    lines = []
    warm_up_vocoder(vocoder, ChunkPolicy(4, 8, 4), max_batch=2, log=lines.append)
    # every length up to 8 + 4 frames at batch 1 and 2 (no graphs on the CPU: every shape runs)
    calls = [line.split(": ", 2)[-1].split(" (")[0] for line in lines[1:-1]]
    assert calls == [f"batch {b} x {frames} frames" for frames in range(1, 13) for b in (1, 2)]


# ---------------------------------------------------------------- the switch, end to end

@pytest.mark.parametrize("device,warmup,rendered", [("cpu", None, "off"), ("cuda", None, "on"),
                                                    ("cuda", False, "off"), ("cpu", True, "on")])
def test_warmup_defaults_on_for_cuda_only(tiny_checkpoint, tmp_path, device, warmup, rendered):
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, device=device, warmup=warmup, left_context_frames=7)
    out = render_repository(config, tmp_path / "repository", ["thinker", "talker", "code2wav"])
    for model in ("thinker", "talker", "code2wav"):
        assert rendered_settings(out, model).resolved_warmup is (rendered == "on")
    code2wav = rendered_settings(out, "code2wav")
    assert (code2wav.next_chunk_frames, code2wav.resolved_left_context_frames) == (25, 7)


def test_inprocess_pipeline_says_the_same_with_and_without_warm_up(tiny_checkpoint):
    from omni_triton.bench.workload import Workload, client_tensors
    from omni_triton.pipeline.inprocess import InProcessPipeline

    tensors = client_tensors(Workload(prompt_tokens=4, thinker_tokens=6, audio_frames=8), "hello there")
    tensors = {**tensors, "TEMPERATURE": np.array([0.9], np.float32), "SEED": np.array([3], np.int64)}
    results = []
    for warmup in (False, True):
        # a small step budget and batch: a short warm-up plan on 2 cores
        config = EngineConfig(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32, warmup=warmup)
        # a short left context: few vocoder shapes to warm on the CPU. The ramp's chunks, not the adaptive
        # pacer's: those follow the clock, and with a 4-frame (inexact) context other chunk cuts give other
        # audio (an H200 run once cut them differently with and without warm-up)
        pipeline = InProcessPipeline(tiny_checkpoint, engine_config=config, policy=ChunkPolicy(4, 8, 4),
                                     chunk_pacing="ramp")
        try:
            results.append(pipeline.generate(tensors))
            assert not pipeline.thinker.engine.requests and not pipeline.talker.engine.requests
        finally:
            pipeline.close()
    (text, audio), (warm_text, warm_audio) = results
    assert text and audio.size
    assert warm_text == text
    np.testing.assert_array_equal(warm_audio, audio)


@pytest.mark.server
def test_served_warm_start_reports_progress_and_serves(tiny_checkpoint, tmp_path, capsys):
    """Each stage's warm-up, then one request end to end, all before ``serve`` says ready."""
    from omni_triton import cli
    from omni_triton.client import OmniStreamClient
    from omni_triton.launch.tritonserver import free_port

    args = cli.build_parser().parse_args([
        "serve", "--checkpoint", str(tiny_checkpoint), "--warmup", "on", "--max-inflight", "4",
        # a cheap warm-up on 2 cores: short prefills, two vocoder call lengths (4; 8 new + 4 context) at batch 1, 2
        "--max-batched-tokens", "32", "--left-context-frames", "4", "--next-chunk-frames", "8",
        "--code2wav-max-batch", "2",
        "--run-dir", str(tmp_path / "run"), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port())])
    server = cli.start_server(args, echo_log=False)
    try:
        with OmniStreamClient(server.grpc_url) as client:
            result = client.stream("hello there", max_tokens=6, max_audio_frames=8, temperature=0.0)
    finally:
        server.stop()
    out = capsys.readouterr().out
    before_ready = out[:out.index("ready in ")]
    for stage in ("thinker", "talker", "code2wav"):
        assert re.search(rf"^{stage}: warm-up .*done in", before_ready, re.MULTILINE), out
    # then one request through the whole served path (its hand-offs' first-use costs), before it says ready
    assert re.search(r"first request through 1 pipeline\(s\): [0-9.]+ s", before_ready), out
    assert result.text and result.audio.size


# ---------------------------------------------------------------- GPU: the fast path (kernels, graphs)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_warm_up_on_the_fast_path_changes_no_output_and_logs_gpu_time(tiny_checkpoint, tmp_path):
    from omni_triton.models.weights import load_talker, load_thinker

    config = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
                  kv_dtype=torch.float32, fast_path=True, cuda_graphs=True)
    thinker = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    prompts = [[t % thinker.vocab_size for t in prompt] for prompt in PROMPTS]

    def thinker_run(engine):
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
            engine.add_request(f"r{i}", params, prompt_token_ids=prompt)
        tokens = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    fresh = thinker_run(LLMEngine(ThinkerStage(thinker), EngineConfig(**config)))
    engine = LLMEngine(ThinkerStage(thinker), EngineConfig(**config))
    trace.configure(tmp_path / "trace")
    try:
        warm_up(engine, log=lambda line: None)
        engine.step_log.flush(wait=True)
    finally:
        trace.configure(None)
    steps = trace.read_records(tmp_path / "trace", "step")
    assert steps and all(step["gpu_ms"] is not None and step["gpu_ms"] >= 0 for step in steps)
    assert any(step["graph"] for step in steps)  # decode steps replayed the CUDA graphs
    assert engine.block_manager.num_used == 0 and thinker_run(engine) == fresh

    talker = load_talker(tiny_checkpoint, "cuda", torch.float32)
    zeros = torch.zeros(talker.hidden_size, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prefills = [torch.randn(5 + 3 * i, talker.hidden_size, generator=gen).cuda() for i in range(len(PARAMS))]

    def talker_run(engine):
        for i, params in enumerate(PARAMS):
            engine.add_request(f"r{i}", params, prompt_embeds=prefills[i], thinker_finished=True)
        codes = {}
        while engine.has_work():
            for out in engine.step():
                if "codes" in out.extras:
                    codes.setdefault(out.request_id, []).append(out.extras["codes"][0].tolist())
        return codes

    def talker_engine():
        return LLMEngine(TalkerStage(talker, tts_eos_embed=zeros, tts_pad_embed=zeros), EngineConfig(**config))

    fresh = talker_run(talker_engine())
    engine = talker_engine()
    warm_up(engine, log=lambda line: None)
    assert engine.block_manager.num_used == 0 and talker_run(engine) == fresh
