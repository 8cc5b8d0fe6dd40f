"""TEMPERATURE 0 with both repetition penalties at 1.0 is transformers' plain greedy generate(), talker included:
the talker's penalty is a request input (TALKER_REPETITION_PENALTY, default 1.05 like generate's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_triton.client import OmniStreamClient

pytestmark = pytest.mark.server

PROMPT = "Tell me a story."
PLAIN_GREEDY = dict(temperature=0.0, repetition_penalty=1.0, talker_repetition_penalty=1.0, max_tokens=12,
                    max_audio_frames=20)


def transformers_waveform(checkpoint, talker_repetition_penalty: float) -> np.ndarray:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_triton.models.config import OmniConfig
    from omni_triton.pipeline.chat import ChatTokenizer

    prompt = torch.tensor([ChatTokenizer.from_checkpoint(checkpoint).encode_prompt(PROMPT)])
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        _, waveform = model.generate(
            prompt, speaker="ethan", return_audio=True, thinker_do_sample=False, talker_do_sample=False,
            talker_repetition_penalty=talker_repetition_penalty, thinker_max_new_tokens=PLAIN_GREEDY["max_tokens"],
            talker_max_new_tokens=PLAIN_GREEDY["max_audio_frames"] + 1,
            thinker_eos_token_id=list(OmniConfig.from_pretrained(checkpoint).thinker_eos_token_ids))
    return waveform.reshape(-1).numpy()


def test_plain_greedy_equals_transformers_with_talker_penalty_1(triton_server, tiny_checkpoint):
    with OmniStreamClient(triton_server.grpc_url) as client:
        plain = client.stream(PROMPT, timeout_s=120, **PLAIN_GREEDY)
        default_penalty = client.stream(PROMPT, timeout_s=120,
                                        **{**PLAIN_GREEDY, "talker_repetition_penalty": None})
    reference = transformers_waveform(tiny_checkpoint, talker_repetition_penalty=1.0)
    assert plain.audio.shape == reference.shape
    np.testing.assert_allclose(plain.audio, reference, atol=1e-4)
    # the input reaches the talker: its default (1.05) speaks differently on this prompt
    assert plain.text == default_penalty.text
    assert plain.audio.shape != default_penalty.audio.shape or not np.allclose(plain.audio, default_penalty.audio)
