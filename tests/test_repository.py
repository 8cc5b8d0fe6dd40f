"""Launch-config rendering: what a deployer chooses reaches every model's config.pbtxt, and each stage reads it
back with its own code (no server needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from omni_triton.launch.repository import render_repository
from omni_triton.shared.placement import Placement
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stages.model_args import engine_config, launch_settings
from server_fixture import rendered_settings, stage_args

TENSOR_STAGES = ("thinker", "talker", "code2wav", "orchestrator")


@pytest.mark.parametrize("memory", ["device", "host"])
def test_interstage_memory_reaches_every_stage_that_exchanges_tensors(tiny_checkpoint, tmp_path, memory):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", interstage_memory=memory),
                            tmp_path / "repository")
    for model in TENSOR_STAGES:
        assert rendered_settings(out, model).interstage_memory == memory, model


@pytest.mark.parametrize("prefill_graphs", [True, False])
def test_prefill_graphs_switch_reaches_both_engines(tiny_checkpoint, tmp_path, prefill_graphs):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", fast_path=True,
                                         cuda_graphs=True, prefill_graphs=prefill_graphs), tmp_path / "repository")
    for model in ("thinker", "talker"):
        config, _ = engine_config(rendered_settings(out, model), model, torch.device("cpu"))
        assert config.prefill_graph_tokens == (None if prefill_graphs else 0), model  # None: the step budget


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_switch_reaches_both_engines(tiny_checkpoint, tmp_path, caching):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, prefix_caching=caching), tmp_path / "repo")
    for model in ("thinker", "talker"):
        config, _ = engine_config(rendered_settings(out, model), model, torch.device("cpu"))
        assert config.prefix_caching == caching, model


@pytest.mark.parametrize("launch", ["one-pass", "split-k", "gemv"])
def test_linear_launch_reaches_the_talker_engine(tiny_checkpoint, tmp_path, launch):
    from omni_triton.models.layers.fast_kernels import LINEAR_LAUNCHES
    from omni_triton.shared.settings import LINEAR_LAUNCHES as SERVED_LINEAR_LAUNCHES

    assert SERVED_LINEAR_LAUNCHES == LINEAR_LAUNCHES
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", fast_path=True,
                                         linear_launch=launch), tmp_path / "repository")
    config, _ = engine_config(rendered_settings(out, "talker"), "talker", torch.device("cpu"))
    assert config.linear_launch == launch


def test_unknown_linear_launch_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(ValueError, match="linear_launch must be one of"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, linear_launch="splitk")


def test_unknown_interstage_memory_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(ValueError, match="interstage_memory"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, interstage_memory="pinned")


def test_left_context_default_is_stateful_where_the_runtime_keeps_state(tiny_checkpoint, tmp_path):
    """Stateful chunks by default on the torch runtime; engine files (one-pass ONNX, TensorRT) default to the
    exact context; TensorRT with stateful is refused at launch, naming the option."""
    rendered = {}
    for runtime, setting in (("torch", None), ("trt", None), ("torch", 25)):
        config = LaunchConfig(checkpoint_dir=tiny_checkpoint, code2wav_runtime=runtime, left_context_frames=setting,
                              code2wav_engine_path=tmp_path / "c.plan" if runtime == "trt" else None)
        out = render_repository(config, tmp_path / f"{runtime}{setting}")
        rendered[(runtime, setting)] = rendered_settings(out, "orchestrator").resolved_left_context_frames
    assert rendered == {("torch", None): "stateful", ("trt", None): "exact", ("torch", 25): 25}
    with pytest.raises(ValueError, match="code2wav_runtime trt keeps no streaming state"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, code2wav_runtime="trt", code2wav_engine_path=tmp_path / "c.plan",
                     left_context_frames="stateful")


def test_every_stage_reads_back_the_settings_it_was_launched_with(tiny_checkpoint, tmp_path):
    """One object, written once per model and read back whole: every field equal, paths made absolute."""
    engine = tmp_path / "code2wav.onnx"
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", dtype="float16", first_chunk_frames=3,
                          left_context_frames=12, admission_capacity="2.5", kv_cache_tokens=4096,
                          talker_kv_cache_tokens=2048, overlap_steps=False, max_audio_seconds=12.5,
                          torch_threads={"thinker": 2, "talker": 3}, code2wav_runtime="onnx",
                          code2wav_engine_path=engine, placement=Placement(gpus={"talker": (1, 2)},
                                                                           instances={"code2wav": 2}))
    out = render_repository(config, tmp_path / "repository")
    expected = dataclasses.replace(config, checkpoint_dir=Path(tiny_checkpoint).resolve(),
                                   code2wav_engine_path=engine.resolve())
    for model in ("preprocess", "orchestrator", "thinker", "talker", "code2wav"):
        assert rendered_settings(out, model) == expected, model
    config, _ = engine_config(rendered_settings(out, "talker"), "talker", torch.device("cpu"))
    assert config.num_blocks == 2048 // 16 and config.overlap_steps is False and config.kv_dtype == torch.float16


def test_the_code2wav_adapter_reads_what_it_was_launched_with(tiny_checkpoint, tmp_path):
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, cuda_graphs=True, first_chunk_frames=6,
                          left_context_frames=7, torch_threads={"code2wav": 3}, load_format="dummy", dummy_seed=5)
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    settings = rendered_settings(out, "code2wav")
    assert (settings.cuda_graphs, settings.first_chunk_frames, settings.resolved_left_context_frames,
            settings.threads_of("code2wav"), settings.load_format, settings.dummy_seed, settings.resolved_warmup,
            settings.resolved_dtype) == (True, 6, 7, 3, "dummy", 5, False, "float32")


def test_a_repository_without_settings_or_with_an_unknown_one_is_refused_by_name(tiny_checkpoint, tmp_path):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint), tmp_path / "repository", ["thinker"])
    args = stage_args((out / "thinker" / "config.pbtxt").read_text(), "thinker")
    model_config = json.loads(args["model_config"])
    settings = json.loads(model_config["parameters"]["settings"]["string_value"])
    model_config["parameters"]["settings"]["string_value"] = json.dumps({**settings, "kv_cache_tokenz": 1})
    with pytest.raises(ValueError, match="unknown field 'kv_cache_tokenz'"):
        launch_settings({**args, "model_config": json.dumps(model_config)})
    model_config["parameters"]["settings"]["string_value"] = json.dumps({**settings, "kv_block_size": 0})
    with pytest.raises(ValueError, match="kv_block_size must be >= 1"):
        launch_settings({**args, "model_config": json.dumps(model_config)})
    del model_config["parameters"]["settings"]
    with pytest.raises(ValueError, match="no 'settings' parameter"):
        launch_settings({**args, "model_config": json.dumps(model_config)})
