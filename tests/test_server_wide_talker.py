"""A checkpoint whose talker vocabulary is larger than the codec's codebook (valid for transformers: it only needs
vocab >= codebook + 1024). Its talker emits first codes past the codebook; transformers' Code2Wav decodes them
with the next quantizer's embedding rows, and the served audio must equal transformers' audio."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TEST_LIMITS
from omni_triton.client import OmniStreamClient
from server_fixture import serving

pytestmark = pytest.mark.server

PROMPT = "Hello, how are you today?"
# greedy thinker as transformers' generate() runs it (no repetition penalty); the talker keeps its default 1.05
GREEDY = dict(temperature=0.0, repetition_penalty=1.0, max_tokens=12, max_audio_frames=20)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("wide") / "tiny-wide-talker", "tiny-wide-talker")


@pytest.fixture(scope="module")
def server(wide_checkpoint, tmp_path_factory):
    with serving(wide_checkpoint, tmp_path_factory.mktemp("wide-triton"), **TEST_LIMITS) as handle:
        yield handle


def transformers_generate(checkpoint) -> tuple[torch.Tensor, np.ndarray]:
    """(the codes transformers decodes [G, N], its waveform) for the GREEDY request."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_triton.models.config import OmniConfig
    from omni_triton.pipeline.chat import ChatTokenizer

    prompt = torch.tensor([ChatTokenizer.from_checkpoint(checkpoint).encode_prompt(PROMPT)])
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    decoded = {}
    chunked_decode = model.code2wav.chunked_decode

    def record(codes, **kwargs):
        decoded["codes"] = codes[0]
        return chunked_decode(codes, **kwargs)

    model.code2wav.chunked_decode = record
    with torch.no_grad():
        _, waveform = model.generate(
            prompt, speaker="ethan", return_audio=True, thinker_do_sample=False, talker_do_sample=False,
            thinker_max_new_tokens=GREEDY["max_tokens"], talker_max_new_tokens=GREEDY["max_audio_frames"] + 1,
            thinker_eos_token_id=list(OmniConfig.from_pretrained(checkpoint).thinker_eos_token_ids))
    return decoded["codes"], waveform.reshape(-1).numpy()


def test_codes_past_the_codebook_are_decoded_as_transformers_does(server, wide_checkpoint):
    with OmniStreamClient(server.grpc_url) as client:
        served = client.stream(PROMPT, timeout_s=120, **GREEDY)
    codes, reference = transformers_generate(wide_checkpoint)
    codebook_size = json.loads((wide_checkpoint / "config.json").read_text())["code2wav_config"]["codebook_size"]
    assert int(codes[0].max()) >= codebook_size, "the talker emitted no code past the codebook: nothing tested"
    assert served.audio.shape == reference.shape
    np.testing.assert_allclose(served.audio, reference, atol=1e-4)
