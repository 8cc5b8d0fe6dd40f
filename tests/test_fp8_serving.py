"""``--quantization fp8`` from the command line to the stages, and FP8 weights behind a real tritonserver.

Unit: the flag's values (an unknown one is refused naming it), the launch settings rendered into the thinker's and
talker's config.pbtxt and the stages reading them back, the memory plan counting FP8 bytes. Served: the tiny
checkpoint with ``quantization="fp8"`` streams text and audio equal to the in-process pipeline quantized the
same way, and not the unquantized pipeline's audio (the flag reached the stages).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TEST_LIMITS
from omni_triton.launch.repository import render_repository
from omni_triton.models.quantization import QUANTIZATIONS
from omni_triton.shared.settings import QUANTIZATIONS as LAUNCH_QUANTIZATIONS, LaunchConfig
from omni_triton.stages.model_args import quantization
from server_fixture import rendered_settings

PROMPT = "Tell me a story."
GREEDY = dict(temperature=0.0, repetition_penalty=1.0, max_tokens=10, max_audio_frames=16)


def test_launch_quantizations_are_the_models_plus_none():
    assert LAUNCH_QUANTIZATIONS == ("none", *QUANTIZATIONS)


def test_unknown_quantization_is_refused_naming_it(tiny_checkpoint, capsys):
    from omni_triton.cli import main

    with pytest.raises(ValueError, match="quantization must be one of .* got 'int4'"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, quantization="int4")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--checkpoint", str(tiny_checkpoint), "--quantization", "int4"])
    assert exit_info.value.code == 2
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_quantization_reaches_the_thinker_and_talker_settings(tiny_checkpoint, tmp_path):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, quantization="fp8"), tmp_path)
    for stage in ("thinker", "talker"):
        assert quantization(rendered_settings(out, stage)) == "fp8", stage
    assert quantization(LaunchConfig(checkpoint_dir=tiny_checkpoint)) is None


def test_memory_plan_counts_fp8_weights_at_one_byte():
    from omni_triton.models.config import FULL_SIZE_CONFIG, resolve_config_dir
    from omni_triton.launch.memory_plan import Footprint

    config_dir = resolve_config_dir(FULL_SIZE_CONFIG)
    plain = Footprint.from_checkpoint(config_dir, torch.bfloat16)
    fp8 = Footprint.from_checkpoint(config_dir, torch.bfloat16, "fp8")
    # the experts and attention halve; embeddings, lm heads, routers, audio encoder and Code2Wav stay bf16, and the
    # talker whole (served in bf16: quantization.served_in_fp8)
    assert 0.5 < fp8.thinker_bytes / plain.thinker_bytes < 0.55
    assert fp8.code2wav_bytes == plain.code2wav_bytes and fp8.talker_bytes == plain.talker_bytes
    assert fp8.weight_bytes < 37 * 2 ** 30 < 64 * 2 ** 30 < plain.weight_bytes


def test_fp8_on_an_80gb_h100_plans_the_thinker_kv_target_with_the_talker_in_bf16(monkeypatch):
    """Issue 44's target (>= 200k thinker KV tokens on one 80 GB H100, 78.7 GiB free at launch) with the talker's
    ~3 GiB the served policy keeps in bf16: the plan serve prints (``--max-inflight 64``, fp8_device.sh's)."""
    from omni_triton.launch import memory_plan
    from omni_triton.launch.options import with_kv_budget
    from omni_triton.models.config import FULL_SIZE_CONFIG, resolve_config_dir

    monkeypatch.setattr(memory_plan, "gpu_memory", lambda: {0: (int(78.7 * 2 ** 30), "NVIDIA H100 80GB HBM3")})
    config = LaunchConfig(checkpoint_dir=resolve_config_dir(FULL_SIZE_CONFIG), load_format="dummy", device="cuda",
                          quantization="fp8", max_inflight_requests=64)
    planned, note = with_kv_budget(config, "auto", memory_plan.DEFAULT_UTILIZATION)
    assert planned.kv_cache_tokens >= 200_000, note
    assert "talker 20 layers 6.2 GiB" in note  # bf16: 2 bytes a weight


@pytest.mark.server
def test_served_fp8_streams_as_the_fp8_inprocess_pipeline(tiny_checkpoint, tmp_path):
    from omni_triton.client import OmniStreamClient
    from omni_triton.pipeline.inprocess import InProcessPipeline
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path / "triton", quantization="fp8", **TEST_LIMITS) as server:
        with OmniStreamClient(server.grpc_url) as client:
            served = client.stream(PROMPT, timeout_s=120, **GREEDY)
    assert served.text and served.audio.size > 0
    # the talker stage served its weights in the model dtype and said so (quantization.served_in_fp8); the thinker FP8
    log = (tmp_path / "triton" / "tritonserver.log").read_text(errors="replace")
    assert "talker: served in float32, not FP8" in log and "thinker: served in" not in log, log[-3000:]
    request = {"TEXT": np.array([PROMPT.encode()], dtype=np.object_), "TEMPERATURE": np.array([0.0], np.float32),
               "REPETITION_PENALTY": np.array([1.0], np.float32), "MAX_TOKENS": np.array([10], np.int32),
               "MAX_AUDIO_FRAMES": np.array([16], np.int32)}
    outputs = {}
    for name, quantized in (("fp8", "fp8"), ("plain", None)):
        pipeline = InProcessPipeline(tiny_checkpoint, quantization=quantized)
        try:
            outputs[name] = pipeline.generate(request)
        finally:
            pipeline.close()
    text, audio = outputs["fp8"]
    assert served.text == text
    np.testing.assert_allclose(served.audio, audio, atol=1e-4)
    plain_audio = outputs["plain"][1]
    assert plain_audio.shape != audio.shape or not np.allclose(plain_audio, audio, atol=1e-4)
