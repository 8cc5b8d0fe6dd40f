"""Client inputs -> RequestParams: defaults, every rejection naming its field, and the accepted boundaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_triton.pipeline.request_params import (MIN_AUDIO_SAMPLES, TALKER_REPETITION_PENALTY, InvalidRequest,
                                                 RequestLimits, SamplingDefaults, check_context, parse_request)

LIMITS = RequestLimits(max_text_chars=100, max_audio_seconds=2.0, max_tokens_cap=64, default_max_tokens=16,
                       max_audio_frames_cap=500)
SPEAKERS = {"Chelsie": 2301, "Ethan": 2302, "Aiden": 2303}


def text(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def parse(**inputs):
    inputs.setdefault("TEXT", text("hello"))
    return parse_request(inputs, LIMITS, SPEAKERS)


def test_defaults_fill_every_optional_input():
    params = parse()
    defaults = SamplingDefaults()
    assert params.text == "hello" and params.audio is None
    assert (params.max_tokens, params.min_tokens) == (LIMITS.default_max_tokens, 0)
    assert (params.speaker, params.speaker_id) == ("ethan", 2302)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty)
    assert params.seed == -1 and params.return_audio and not params.ignore_eos and not params.sequential
    assert (params.max_audio_frames, params.min_audio_frames) == (0, 0)


def test_generation_config_overrides_sampling_defaults():
    defaults = SamplingDefaults.from_generation_config({"temperature": 0.9, "top_k": 50, "eos_token_id": [1]})
    params = parse_request({"TEXT": text("x")}, LIMITS, SPEAKERS, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.9, 50, SamplingDefaults().top_p)


def test_given_values_are_typed_and_kept():
    params = parse(MAX_TOKENS=np.array([64], np.int32), MIN_TOKENS=np.array([64], np.int32),
                   SPEAKER=text(" AIDEN "), TEMPERATURE=np.array([0.0], np.float32),
                   TOP_P=np.array([1.0], np.float32), TOP_K=np.array([0], np.int32),
                   REPETITION_PENALTY=np.array([1.2], np.float32), SEED=np.array([2**40], np.int64),
                   RETURN_AUDIO=np.array([False]), IGNORE_EOS=np.array([True]), SEQUENTIAL=np.array([True]),
                   MAX_AUDIO_FRAMES=np.array([500], np.int32), MIN_AUDIO_FRAMES=np.array([500], np.int32))
    assert (params.max_tokens, params.min_tokens, params.speaker_id, params.top_k, params.seed) == (
        64, 64, 2303, 0, 2**40)
    assert isinstance(params.max_tokens, int) and isinstance(params.temperature, float)
    assert params.temperature == 0.0 and params.top_p == 1.0 and params.repetition_penalty == pytest.approx(1.2)
    assert not params.return_audio and params.ignore_eos and params.sequential
    assert (params.max_audio_frames, params.min_audio_frames) == (500, 500)


def test_spoken_input_may_replace_text():
    audio = np.zeros(MIN_AUDIO_SAMPLES, np.float32)
    params = parse(TEXT=text(""), AUDIO_IN=audio)
    assert params.text == "" and params.audio is audio
    assert parse(TEXT=None, AUDIO_IN=audio).text == ""  # no TEXT tensor at all


def test_neither_text_nor_audio_names_both():
    with pytest.raises(InvalidRequest, match="TEXT is required when no AUDIO_IN is given"):
        parse_request({"MAX_TOKENS": np.array([3], np.int32)}, LIMITS, SPEAKERS)


def test_repetition_penalties_default_to_transformers_generate():
    """generate() applies none to the thinker (GenerationConfig's 1.0) and talker_repetition_penalty=1.05."""
    assert parse().talker_repetition_penalty == TALKER_REPETITION_PENALTY == 1.05
    assert parse().repetition_penalty == 1.0
    tuned = SamplingDefaults.from_generation_config({"repetition_penalty": 1.1})
    assert parse_request({"TEXT": text("hi")}, LIMITS, SPEAKERS, tuned).repetition_penalty == pytest.approx(1.1)
    plain = parse(TALKER_REPETITION_PENALTY=np.array([1.0], np.float32), REPETITION_PENALTY=np.array([1.0], np.float32))
    assert (plain.talker_repetition_penalty, plain.repetition_penalty) == (1.0, 1.0)


REJECTED = {
    "no text": ("TEXT", dict(TEXT=None)),
    "empty text": ("TEXT", dict(TEXT=text(""))),
    "blank text": ("TEXT", dict(TEXT=text(" \n\t"))),
    "text over the limit": ("TEXT", dict(TEXT=text("é" * 101))),
    "invalid utf-8": ("TEXT", dict(TEXT=text(b"\xff\xfe"))),
    "text as int": ("TEXT", dict(TEXT=np.array([3], np.int32))),
    "two texts": ("TEXT", dict(TEXT=np.array([b"a", b"b"], dtype=np.object_))),
    "max tokens 0": ("MAX_TOKENS", dict(MAX_TOKENS=np.array([0], np.int32))),
    "max tokens negative": ("MAX_TOKENS", dict(MAX_TOKENS=np.array([-3], np.int32))),
    "max tokens over cap": ("MAX_TOKENS", dict(MAX_TOKENS=np.array([65], np.int32))),
    "max tokens float": ("MAX_TOKENS", dict(MAX_TOKENS=np.array([5.0], np.float32))),
    "max tokens empty": ("MAX_TOKENS", dict(MAX_TOKENS=np.zeros(0, np.int32))),
    "min tokens over max": ("MIN_TOKENS", dict(MAX_TOKENS=np.array([3], np.int32), MIN_TOKENS=np.array([4], np.int32))),
    "unknown speaker": ("SPEAKER", dict(SPEAKER=text("bob"))),
    "speaker invalid utf-8": ("SPEAKER", dict(SPEAKER=text(b"\xc3"))),
    "nan temperature": ("TEMPERATURE", dict(TEMPERATURE=np.array([math.nan], np.float32))),
    "inf temperature": ("TEMPERATURE", dict(TEMPERATURE=np.array([math.inf], np.float32))),
    "negative temperature": ("TEMPERATURE", dict(TEMPERATURE=np.array([-0.1], np.float32))),
    "temperature as int": ("TEMPERATURE", dict(TEMPERATURE=np.array([1], np.int32))),
    "top_p 0": ("TOP_P", dict(TOP_P=np.array([0.0], np.float32))),
    "top_p over 1": ("TOP_P", dict(TOP_P=np.array([1.01], np.float32))),
    "top_p nan": ("TOP_P", dict(TOP_P=np.array([math.nan], np.float32))),
    "negative top_k": ("TOP_K", dict(TOP_K=np.array([-1], np.int32))),
    "repetition penalty 0": ("REPETITION_PENALTY", dict(REPETITION_PENALTY=np.array([0.0], np.float32))),
    "talker repetition penalty 0": ("TALKER_REPETITION_PENALTY",
                                    dict(TALKER_REPETITION_PENALTY=np.array([0.0], np.float32))),
    "talker repetition penalty nan": ("TALKER_REPETITION_PENALTY",
                                      dict(TALKER_REPETITION_PENALTY=np.array([math.nan], np.float32))),
    "seed below -1": ("SEED", dict(SEED=np.array([-2], np.int64))),
    "return audio as int": ("RETURN_AUDIO", dict(RETURN_AUDIO=np.array([1], np.int32))),
    "audio frames over cap": ("MAX_AUDIO_FRAMES", dict(MAX_AUDIO_FRAMES=np.array([501], np.int32))),
    "min audio frames over max": ("MIN_AUDIO_FRAMES", dict(MAX_AUDIO_FRAMES=np.array([10], np.int32),
                                                           MIN_AUDIO_FRAMES=np.array([11], np.int32))),
    "audio nan": ("AUDIO_IN", dict(AUDIO_IN=np.array([0.0, math.nan] * 1000, np.float32))),
    "audio inf": ("AUDIO_IN", dict(AUDIO_IN=np.array([math.inf] * 2000, np.float32))),
    "audio too long": ("AUDIO_IN", dict(AUDIO_IN=np.zeros(32001, np.float32))),
    "audio too short": ("AUDIO_IN", dict(AUDIO_IN=np.zeros(MIN_AUDIO_SAMPLES - 1, np.float32))),
    "audio rank 2": ("AUDIO_IN", dict(AUDIO_IN=np.zeros((1, 16000), np.float32))),
    "audio float64": ("AUDIO_IN", dict(AUDIO_IN=np.zeros(16000, np.float64))),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_invalid_input_names_its_field(case):
    field, inputs = REJECTED[case]
    with pytest.raises(InvalidRequest) as raised:
        parse(**inputs)
    assert raised.value.field == field
    assert str(raised.value).startswith(field + " ")


def test_messages_carry_the_bad_value():
    with pytest.raises(InvalidRequest, match=r"MAX_TOKENS must be in \[1, 64\], got 0"):
        parse(MAX_TOKENS=np.array([0], np.int32))
    with pytest.raises(InvalidRequest, match="'bob'"):
        parse(SPEAKER=text("bob"))


def test_context_check_counts_prompt_and_new_tokens():
    check_context(num_prompt_tokens=100, max_tokens=28, context_tokens=128)
    with pytest.raises(InvalidRequest, match="TEXT is too long: the prompt is 101 tokens"):
        check_context(num_prompt_tokens=101, max_tokens=28, context_tokens=128)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=LIMITS.max_text_chars).filter(str.strip))
def test_any_text_within_the_limit_round_trips(value):
    assert parse(TEXT=text(value)).text == value
