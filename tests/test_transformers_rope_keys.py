"""The talker's mrope keys no longer make transformers warn while a Qwen3-Omni config is built; other
unrecognised rope keys still do."""

from __future__ import annotations

import logging

import pytest

from omni_triton.checkpoints.transformers_rope_keys import quiet_mrope_key_warning

transformers = pytest.importorskip("transformers")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _talker_text_config_warnings(rope_parameters: dict, quiet: bool) -> list[str]:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerTextConfig

    logger, collect = logging.getLogger("transformers.modeling_rope_utils"), _Collect()
    logger.addHandler(collect)
    try:
        if quiet:
            with quiet_mrope_key_warning():
                Qwen3OmniMoeTalkerTextConfig(rope_parameters=rope_parameters)
        else:
            Qwen3OmniMoeTalkerTextConfig(rope_parameters=rope_parameters)
    finally:
        logger.removeHandler(collect)
    return [m for m in collect.messages if m.startswith("Unrecognized keys")]


MROPE = dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3], interleaved=True, mrope_interleaved=True)


def test_transformers_warns_about_the_talker_mrope_keys_without_the_filter():
    # if this fails, transformers declares the keys itself: delete omni_triton/checkpoints/transformers_rope_keys.py
    assert _talker_text_config_warnings(dict(MROPE), quiet=False)


def test_the_filter_drops_only_the_mrope_key_warning():
    assert _talker_text_config_warnings(dict(MROPE), quiet=True) == []
    assert _talker_text_config_warnings(dict(MROPE, bogus_key=1), quiet=True)
