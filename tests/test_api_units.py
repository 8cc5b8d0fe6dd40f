"""Pure parts of the OpenAI-compatible API: error translation, field paths, wire encodings."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the API needs the `api` extra")

from omni_triton.api.encoding import audio_frames, pcm16_bytes, sse, streamed_wav_header  # noqa: E402
from omni_triton.api.errors import TritonRequestError, from_triton  # noqa: E402
from omni_triton.api.prompt import CHAT_PARAMS  # noqa: E402
from omni_triton.api.schema import field_path  # noqa: E402


def test_invalid_arg_names_the_request_field():
    error = TritonRequestError("INVALID_ARG", "in ensemble 'omni', [INVALID_ARG] SPEAKER must be one of "
                                              "['aiden', 'ethan'], got 'alloy'")
    api_error = from_triton(error, CHAT_PARAMS, "req")
    assert (api_error.status, api_error.param) == (400, "audio.voice")
    assert api_error.message == "audio.voice must be one of ['aiden', 'ethan'], got 'alloy'"


def test_statuses_and_no_internals_in_a_500():
    assert from_triton(TritonRequestError("UNAVAILABLE", "stage down"), {}, "r").status == 503
    internal = from_triton(TritonRequestError("INTERNAL", "Traceback ... secret path /opt/x"), {}, "r7")
    assert internal.status == 500 and "secret" not in internal.message and "r7" in internal.message


@pytest.mark.parametrize("location, path", [
    (("body", "temperature"), "temperature"),
    (("messages", 0, "content", "list[tagged-union[TextPart,AudioPart]]", 1, "input_audio", "input_audio", "format"),
     "messages[0].content[1].input_audio.format"),
    (("messages", 2, "content", "str"), "messages[2].content"),
    (("audio", "voice"), "audio.voice"),
])
def test_field_path(location, path):
    assert field_path(location) == path


def test_streamed_wav_reads_as_wav():
    pcm = pcm16_bytes(np.array([0.0, 0.5, -1.0, 2.0], np.float32))
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 16384, -32767, 32767]
    with wave.open(io.BytesIO(streamed_wav_header() + pcm)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert np.frombuffer(wav.readframes(4), "<i2").tolist() == [0, 16384, -32767, 32767]


def test_frames_and_sse():
    assert [audio_frames(n) for n in (0, 1, 1920, 1921)] == [0, 1, 1, 2]
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"


def test_the_benchmark_sends_what_the_api_takes():
    """The bench runner's request body for the fixed workload is a valid chat completion that asks for the
    same things the gRPC runner's tensors do."""
    from omni_triton.api.prompt import chat_request
    from omni_triton.api.schema import ChatCompletionRequest
    from omni_triton.bench.runners.openai_api import chat_body
    from omni_triton.bench.workload import QUICK, client_tensors

    body = chat_body(client_tensors(QUICK, "a calm story"))
    omni = chat_request(ChatCompletionRequest.model_validate(body))
    assert omni.turn.text == "a calm story" and omni.turn.audio is None
    assert {k: v for k, v in omni.scalars.items() if v is not None} == {
        "max_tokens": QUICK.thinker_tokens, "min_tokens": QUICK.thinker_tokens, "ignore_eos": True,
        "max_audio_frames": QUICK.audio_frames, "min_audio_frames": QUICK.audio_frames, "temperature": 0.0,
        "seed": QUICK.seed, "return_audio": True}
