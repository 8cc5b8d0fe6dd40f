"""Launch-config rendering: what a deployer chooses reaches every model's config.pbtxt (no server needed)."""

from __future__ import annotations

import re

import pytest

from omni_triton.server.repository import LaunchConfig, render_repository

TENSOR_STAGES = ("thinker", "talker", "code2wav", "orchestrator")


def _parameter(config_text: str, key: str) -> str | None:
    match = re.search(r'key: "%s" value: \{ string_value: "([^"]*)" \}' % key, config_text)
    return match.group(1) if match else None


@pytest.mark.parametrize("memory", ["device", "host"])
def test_interstage_memory_reaches_every_stage_that_exchanges_tensors(tiny_checkpoint, tmp_path, memory):
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", interstage_memory=memory),
                            tmp_path / "repository")
    for model in TENSOR_STAGES:
        assert _parameter((out / model / "config.pbtxt").read_text(), "interstage_memory") == memory, model


def test_unknown_interstage_memory_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(ValueError, match="interstage_memory"):
        LaunchConfig(checkpoint_dir=tiny_checkpoint, interstage_memory="pinned")
