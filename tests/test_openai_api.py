"""The OpenAI-compatible API (``omni-triton api``) against a real tritonserver on the tiny checkpoint, with the
official ``openai`` package as the client: chat completions (streamed and not, text and audio, spoken input),
speech in both stream formats, bad input, an unreachable model server, and a client that disconnects."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import wave

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the API tests use the official openai client")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from omni_triton.api.app import create_app  # noqa: E402
from omni_triton.client import OmniStreamClient, to_pcm16, write_wav  # noqa: E402
from omni_triton.launch.tritonserver import free_port  # noqa: E402
from reliability_helpers import VICTIM_REQUEST, held_state, read_gauges, seconds_until_idle  # noqa: E402

pytestmark = pytest.mark.server

PROMPT = "Hello, how are you today?"
# seeded sampling: the gRPC client and the API must get the same text and audio
SEEDED = dict(seed=11, temperature=0.9, top_p=0.8, max_tokens=8)
FRAMES = dict(max_audio_frames=12)


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    """The same samples up to float rounding: where each stream's audio chunks are cut follows its frame
    timing (--chunk-pacing adaptive), and decoding the same frames in other chunk splits rounds differently in
    the last bits (exact context / stateful vocoder: ~1e-5 of full scale), i.e. a PCM16 step or two."""
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.int32), want.astype(np.int32), rtol=0, atol=4)


class ApiServer:
    """The API app on uvicorn in a thread of this process, on a free port."""

    def __init__(self, triton_grpc: str, checkpoint_dir=None, **app_options):
        self.app = create_app(triton_grpc, checkpoint_dir=checkpoint_dir, **app_options)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ApiServer":
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited before it started"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def api(triton_server):
    with ApiServer(triton_server.grpc_url, triton_server.checkpoint_dir) as server:
        yield server


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url + "/v1", api_key="not-checked", max_retries=0)


def grpc_reference(triton_server, text: str, audio_in=None, **scalars):
    with OmniStreamClient(triton_server.grpc_url) as grpc_client:
        return grpc_client.stream(text, audio_in, **scalars)


def pcm16(data_b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data_b64), "<i2")


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return np.frombuffer(wav.readframes(wav.getnframes()), "<i2"), wav.getframerate()


# -- chat completions --------------------------------------------------------------------------------

def test_streamed_chat_with_audio_equals_the_grpc_client(client, triton_server):
    reference = grpc_reference(triton_server, PROMPT, **SEEDED, **FRAMES)
    assert reference.audio.size and reference.text
    stream = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": PROMPT}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"}, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=SEEDED["max_tokens"], temperature=SEEDED["temperature"], top_p=SEEDED["top_p"],
        seed=SEEDED["seed"], extra_body=FRAMES)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    audio_deltas = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert len({a.id for a in audio_deltas}) == 1 and audio_deltas[-1].expires_at is not None
    audio = np.concatenate([pcm16(a.data) for a in audio_deltas if a.data])
    transcript = "".join(a.transcript or "" for a in audio_deltas)

    assert text == transcript == reference.text
    assert_same_audio(audio, to_pcm16(reference.audio))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens_details.audio_tokens == -(-audio.size // 1920)
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_with_audio_not_streamed_wav_and_pcm16(client, triton_server):
    reference = grpc_reference(triton_server, PROMPT, **SEEDED, **FRAMES)
    for audio_format in ("wav", "pcm16"):
        completion = client.chat.completions.create(
            model="omni", messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            modalities=["text", "audio"], audio={"voice": "ethan", "format": audio_format},
            max_tokens=SEEDED["max_tokens"], temperature=SEEDED["temperature"], top_p=SEEDED["top_p"],
            seed=SEEDED["seed"], extra_body=FRAMES)
        message = completion.choices[0].message
        assert message.content == message.audio.transcript == reference.text
        data = base64.b64decode(message.audio.data)
        if audio_format == "wav":
            samples, rate = wav_samples(data)
            assert rate == 24000
        else:
            samples = np.frombuffer(data, "<i2")
        assert_same_audio(samples, to_pcm16(reference.audio))
        assert message.audio.id.startswith("audio_") and isinstance(message.audio.expires_at, int)
        assert completion.usage.completion_tokens_details.audio_tokens == -(-samples.size // 1920)


def test_text_only_chat(client, triton_server):
    reference = grpc_reference(triton_server, PROMPT, seed=3, max_tokens=6, return_audio=False)
    completion = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": PROMPT}],
                                                seed=3, max_tokens=6)
    message = completion.choices[0].message
    assert message.content == reference.text and message.audio is None
    assert completion.usage.completion_tokens_details.audio_tokens == 0
    streamed = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": PROMPT}],
                                              seed=3, max_tokens=6, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert not any(c.choices[0].delta.audio for c in chunks)
    assert chunks[-1].usage is None, "usage only with stream_options.include_usage"


def test_spoken_input(client, triton_server, tmp_path):
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(8000) / 16000)).astype(np.float32)  # 0.5 s at 16 kHz
    write_wav(tmp_path / "in.wav", tone, sample_rate=16000)
    wav_b64 = base64.b64encode((tmp_path / "in.wav").read_bytes()).decode()
    from omni_triton.client import read_wav

    reference = grpc_reference(triton_server, "What is this sound?", read_wav(tmp_path / "in.wav"), **SEEDED,
                               **FRAMES)
    completion = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": wav_b64, "format": "wav"}},
            {"type": "text", "text": "What is this sound?"}]}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        max_tokens=SEEDED["max_tokens"], temperature=SEEDED["temperature"], top_p=SEEDED["top_p"],
        seed=SEEDED["seed"], extra_body=FRAMES)
    message = completion.choices[0].message
    assert message.content == reference.text
    assert_same_audio(pcm16(message.audio.data), to_pcm16(reference.audio))
    text_only = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=1)
    assert completion.usage.prompt_tokens > text_only.usage.prompt_tokens, "the audio pads count in the prompt"


# -- speech ------------------------------------------------------------------------------------------

def test_speech_audio_stream_wav_and_pcm(client, triton_server):
    reference = grpc_reference(triton_server, PROMPT, seed=5, **FRAMES)
    expected = to_pcm16(reference.audio)
    with client.audio.speech.with_streaming_response.create(
            model="omni", input=PROMPT, voice="ethan", response_format="wav", extra_body=dict(seed=5, **FRAMES)) \
            as response:
        assert response.headers["content-type"] == "audio/wav"
        data = b"".join(response.iter_bytes())
    # a streamed WAV: RIFF header with "unknown" sizes, then the PCM as it was made
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert_same_audio(np.frombuffer(data[44:], "<i2"), expected)
    pcm = client.audio.speech.create(model="omni", input=PROMPT, voice="ethan", response_format="pcm",
                                     extra_body=dict(seed=5, **FRAMES))
    assert_same_audio(np.frombuffer(pcm.content, "<i2"), expected)


def test_speech_sse(api, triton_server):
    reference = grpc_reference(triton_server, PROMPT, seed=5, **FRAMES)
    body = dict(model="omni", input=PROMPT, voice="ethan", response_format="pcm", stream_format="sse", seed=5,
                **FRAMES)
    with httpx.Client(timeout=120) as http, http.stream("POST", api.url + "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    audio = np.concatenate([pcm16(e["audio"]) for e in events[:-1]])
    assert_same_audio(audio, to_pcm16(reference.audio))
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["total_tokens"] == (
        done["usage"]["input_tokens"] + done["usage"]["output_tokens"])


# -- bad input, errors ---------------------------------------------------------------------------------

def _bad(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


@pytest.mark.parametrize("changes, param", [
    (dict(temperature=5.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10_000), "max_tokens"),  # the server's cap (INVALID_ARG from its preprocess stage)
    (dict(modalities=["audio"]), "modalities"),
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "audio.voice"),
    (dict(modalities=["text", "audio"], audio={"voice": "ethan", "format": "mp3"}), "audio.format"),
    (dict(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, stream=True), "audio.format"),
    (dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": ""}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "bm90IGEgd2F2", "format": "wav"}}]}]), "messages[0].content[0].input_audio.data"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(n=2), "n"),
    (dict(extra_body={"max_audio_frames": -1}), "max_audio_frames"),
])
def test_bad_chat_input_is_a_400_naming_the_param(client, changes, param):
    arguments = dict(model="omni", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    arguments.update(changes)
    error = _bad(lambda: client.chat.completions.create(**arguments))
    assert error.status_code == 400, error.body
    assert error.body["param"] == param and error.body["type"] == "invalid_request_error", error.body
    assert error.body["message"].startswith(param), error.body


@pytest.mark.parametrize("changes, param", [
    (dict(response_format="mp3"), "response_format"),
    (dict(speed=1.5), "speed"),
    (dict(voice="nobody"), "voice"),
    (dict(input=""), "input"),
    (dict(stream_format="chunks"), "stream_format"),
])
def test_bad_speech_input_is_a_400_naming_the_param(client, changes, param):
    arguments = dict(model="omni", input="hi", voice="ethan", extra_body=FRAMES)
    arguments.update(changes)
    error = _bad(lambda: client.audio.speech.create(**arguments))
    assert error.status_code == 400 and error.body["param"] == param, error.body


def test_unknown_model_and_bad_json(client, api):
    error = _bad(lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]))
    assert error.status_code == 404 and error.body["param"] == "model" and error.body["code"] == "model_not_found"
    response = httpx.post(api.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_models_and_health(client, api):
    assert [m.id for m in client.models.list()] == ["omni"]
    assert httpx.get(api.url + "/health", timeout=30).json() == {"status": "ready"}


def test_unreachable_triton_is_503(triton_server):
    with ApiServer(f"127.0.0.1:{free_port()}") as down:  # nothing listens there
        down_client = openai.OpenAI(base_url=down.url + "/v1", api_key="x", max_retries=0)
        error = _bad(lambda: down_client.chat.completions.create(
            model="omni", messages=[{"role": "user", "content": "hi"}]))
        assert error.status_code == 503 and error.body["type"] == "service_unavailable", error.body
        health = httpx.get(down.url + "/health", timeout=30)
        assert health.status_code == 503 and "error" in health.json()


# -- a client that goes away ---------------------------------------------------------------------------

LONG_CHAT = dict(model="omni", messages=[{"role": "user", "content": "Tell me a very long story."}],
                 modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                 max_tokens=VICTIM_REQUEST["max_tokens"], temperature=VICTIM_REQUEST["temperature"],
                 **{k: VICTIM_REQUEST[k] for k in ("max_audio_frames", "min_audio_frames", "ignore_eos")})


def _wait_for_cancel(bridge, cancelled_before: int, prefix: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a latency bound
    while len(bridge.cancelled) == cancelled_before:
        assert time.monotonic() < deadline, "the API never cancelled the Triton request"
        time.sleep(0.05)
    assert bridge.cancelled[-1].startswith(prefix)


def test_disconnect_mid_stream_cancels_the_triton_request(api, client, triton_server):
    """The HTTP client drops the connection at its first audio; the API cancels the Triton request (the
    orchestrator accepts the control cancel for its id) and every stage frees its state."""
    bridge = api.app.state.bridge
    cancelled_before = len(bridge.cancelled)
    with httpx.Client(timeout=120) as http, http.stream("POST", api.url + "/v1/chat/completions",
                                                        json=dict(LONG_CHAT, stream=True)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and '"data":' in line:
                break  # the first audio: leave (closing the response drops the connection)
        else:
            pytest.fail("the stream ended before its first audio")
    _wait_for_cancel(bridge, cancelled_before, "chatcmpl-")
    seconds_until_idle(triton_server.metrics_url, timeout_s=60.0)
    # and the server serves the next request
    assert client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(api, triton_server):
    """A non-streamed request whose client goes away while the stages hold it is cancelled too."""
    bridge = api.app.state.bridge
    cancelled_before = len(bridge.cancelled)
    body = json.dumps(LONG_CHAT).encode()
    with socket.create_connection(("127.0.0.1", api.port), timeout=60) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60  # a hang guard
        while not held_state(read_gauges(triton_server.metrics_url)):
            assert time.monotonic() < deadline, "the request never reached the stages"
            time.sleep(0.05)
    _wait_for_cancel(bridge, cancelled_before, "chatcmpl-")
    seconds_until_idle(triton_server.metrics_url, timeout_s=60.0)
