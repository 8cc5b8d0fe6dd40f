"""Preprocess refuses, with INVALID_ARG naming the input, requests the talker could not serve: before this
check they failed inside the talker, after its first response, and the client never heard back."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from omni_triton.pipeline.preprocess import Preprocessor
from omni_triton.pipeline.request_params import InvalidRequest, RequestLimits

CACHE_TOKENS = 64


def request(**inputs):
    return {"TEXT": np.array([b"Hello there"], dtype=np.object_), "MAX_TOKENS": np.array([8], np.int32), **inputs}


@pytest.fixture(scope="module")
def preprocessor(tiny_checkpoint):
    return Preprocessor(tiny_checkpoint, RequestLimits(), kv_cache_tokens=CACHE_TOKENS)


def test_audio_frames_past_the_talker_cache_are_refused(preprocessor):
    with pytest.raises(InvalidRequest, match=r"MAX_AUDIO_FRAMES does not fit the talker: its KV cache holds (\d+) "
                                             r"audio frames after this request's (\d+)-position") as refused:
        preprocessor(request(MAX_AUDIO_FRAMES=np.array([CACHE_TOKENS], np.int32)))
    most_frames, prefill = map(int, re.search(r"holds (\d+) .* (\d+)-position", str(refused.value)).groups())
    assert most_frames == CACHE_TOKENS - prefill - 1
    accepted = preprocessor(request(MAX_AUDIO_FRAMES=np.array([most_frames], np.int32)))
    assert accepted["MAX_AUDIO_FRAMES"][0] == most_frames
    # text only: the talker never runs
    preprocessor(request(MAX_AUDIO_FRAMES=np.array([CACHE_TOKENS], np.int32), RETURN_AUDIO=np.array([False])))


def test_a_prompt_the_talker_cannot_speak_asks_for_text_only(tiny_checkpoint, tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path / name)
    tokenizer_config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    preprocessor = Preprocessor(tmp_path, RequestLimits(), kv_cache_tokens=CACHE_TOKENS)
    with pytest.raises(InvalidRequest, match="RETURN_AUDIO cannot be true .* no '<|im_start|>assistant' turn"):
        preprocessor(request())
    assert preprocessor(request(RETURN_AUDIO=np.array([False])))["INPUT_IDS"].size
