"""Launch-config rendering: what a deployer chooses reaches every model's config.pbtxt (no server needed)."""

from __future__ import annotations

import pytest

from omni_triton.server.repository import LaunchConfig, render_repository
from server_fixture import rendered_parameters

TENSOR_STAGES = ("thinker", "talker", "code2wav", "orchestrator")


def _parameter(config_text: str, key: str) -> str | None:
    return rendered_parameters(config_text).get(key)


@pytest.mark.parametrize("memory", ["device", "host"])
def test_interstage_memory_reaches_every_stage_that_exchanges_tensors(tiny_checkpoint, tmp_path, memory):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", interstage_memory=memory),
                            tmp_path / "repository")
    for model in TENSOR_STAGES:
        assert _parameter((out / model / "config.pbtxt").read_text(), "interstage_memory") == memory, model


@pytest.mark.parametrize("prefill_graphs", [True, False])
def test_prefill_graphs_switch_reaches_both_engines(tiny_checkpoint, tmp_path, prefill_graphs):
    from omni_triton.server.stage_io import engine_config

    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", fast_path=True,
                                         cuda_graphs=True, prefill_graphs=prefill_graphs), tmp_path / "repository")
    for model in ("thinker", "talker"):
        text = (out / model / "config.pbtxt").read_text()
        params = rendered_parameters(text)
        assert params["prefill_graphs"] == ("on" if prefill_graphs else "off"), model
        config, _ = engine_config(params, device="cpu")
        assert config.prefill_graph_tokens == (None if prefill_graphs else 0), model  # None: the step budget


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_switch_reaches_both_engines(tiny_checkpoint, tmp_path, caching):
    from omni_triton.server.stage_io import engine_config

    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, prefix_caching=caching), tmp_path / "repo")
    for model in ("thinker", "talker"):
        params = rendered_parameters((out / model / "config.pbtxt").read_text())
        assert params["prefix_caching"] == ("on" if caching else "off"), model
        assert engine_config(params)[0].prefix_caching == caching, model


@pytest.mark.parametrize("launch", ["one-pass", "split-k", "gemv"])
def test_linear_launch_reaches_the_talker_engine(tiny_checkpoint, tmp_path, launch):
    from omni_triton.models.layers.fast_kernels import LINEAR_LAUNCHES
    from omni_triton.server.repository import LINEAR_LAUNCHES as SERVED_LINEAR_LAUNCHES
    from omni_triton.server.stage_io import engine_config

    assert SERVED_LINEAR_LAUNCHES == LINEAR_LAUNCHES
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", fast_path=True,
                                         linear_launch=launch), tmp_path / "repository")
    text = (out / "talker" / "config.pbtxt").read_text()
    params = rendered_parameters(text)
    config, _ = engine_config(params, device="cpu")
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
        rendered[(runtime, setting)] = _parameter((out / "orchestrator" / "config.pbtxt").read_text(),
                                                  "left_context_frames")
    assert rendered == {("torch", None): "stateful", ("trt", None): "exact", ("torch", 25): "25"}
    with pytest.raises(ValueError, match="code2wav_runtime trt keeps no streaming state"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, code2wav_runtime="trt", code2wav_engine_path=tmp_path / "c.plan",
                     left_context_frames="stateful")
