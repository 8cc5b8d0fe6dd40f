"""The Realtime WebSocket (``/v1/realtime``) against a real tritonserver on the tiny checkpoint, driven by the
official ``openai`` client's realtime connection (raw WebSocket frames where it has no call): text in and
audio out, turns by server VAD on synthesized speech, a manual commit, barge-in and truncate, a multi-turn
conversation, bad events, two sessions at once, limits, and a client that leaves mid-response.

The tiny checkpoint's weights are random: its words and sounds are noise, but every event, the VAD on real
speech, the history in the prompt and each cancellation are real.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the realtime tests use the official openai client")
pytest.importorskip("websockets")

from omni_triton.api.realtime.session import RealtimeLimits  # noqa: E402
from omni_triton.client import read_wav, resample  # noqa: E402
from reliability_helpers import seconds_until_idle  # noqa: E402
from test_openai_api import ApiServer  # noqa: E402

pytestmark = pytest.mark.server

# small answers: the tiny model on 2 CPU cores speaks ~1 s of audio in a few seconds
SHORT = {"max_output_tokens": 6}
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 200, "silence_duration_ms": 400}
# a long answer to interrupt (frames forced as in the reliability tests' victim request)
LONG_ANSWER = {"max_output_tokens": 60}
EVENT_TIMEOUT_S = 120  # a hang guard, not a latency bound


@pytest.fixture(scope="module")
def api(triton_server):
    with ApiServer(triton_server.grpc_url, triton_server.checkpoint_dir) as server:
        yield server


def async_client(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="not-checked", max_retries=0)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 300))


async def until(connection, kind: str, seen: list | None = None):
    """Events up to and including the first of type ``kind`` (all of them appended to ``seen``)."""
    async with asyncio.timeout(EVENT_TIMEOUT_S):
        while True:
            event = await connection.recv()
            if seen is not None:
                seen.append(event)
            if event.type == "error" and kind != "error":
                raise AssertionError(f"error event while waiting for {kind}: {event.error}")
            if event.type == kind:
                return event


def pcm16_24k(audio_16k: np.ndarray) -> bytes:
    audio = resample(audio_16k, 16000, 24000)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    """About 1.5 s of synthesized English at 16 kHz (espeak-ng), within the test server's 3 s audio limit."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it): no speech to detect")
    path = tmp_path_factory.mktemp("speech") / "hello.wav"
    subprocess.run(["espeak-ng", "-s", "190", "-w", str(path), "Hello there, how are you today?"], check=True)
    return read_wav(path)


def utterance(speech: np.ndarray, silence_s: float = 1.0) -> bytes:
    """Silence, the speech, silence: one turn for the VAD, as 24 kHz PCM16."""
    quiet = np.zeros(int(silence_s * 16000), np.float32)
    return pcm16_24k(np.concatenate([quiet, speech, quiet]))


async def send_audio(connection, pcm: bytes, chunk_ms: int = 100) -> None:
    step = 24000 * 2 * chunk_ms // 1000
    for start in range(0, len(pcm), step):
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[start:start + step]).decode())


def audio_of(events) -> np.ndarray:
    chunks = [np.frombuffer(base64.b64decode(e.delta), "<i2") for e in events if e.type == "response.output_audio.delta"]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


# -- text in, audio out ------------------------------------------------------------------------------

def test_text_turn_is_answered_with_audio_and_transcript(api, triton_server):
    async def scenario():
        async with async_client(api).realtime.connect(model="omni") as connection:
            created = await until(connection, "session.created")
            assert created.session.audio.output.format.rate == 24000
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None},
                                                                                   "output": {"voice": "ethan"}},
                                                     "instructions": "Answer briefly.", **SHORT})
            updated = await until(connection, "session.updated")
            assert updated.session.audio.input.turn_detection is None and updated.session.instructions
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello, how are you?"}]})
            added = await until(connection, "conversation.item.added")
            assert added.item.role == "user" and added.item.content[0].text == "Hello, how are you?"
            await connection.response.create()
            events: list = []
            done = await until(connection, "response.done", events)
            return events, done

    events, done = run(scenario())
    kinds = [e.type for e in events]
    assert kinds.index("response.created") < kinds.index("response.output_item.added") < kinds.index(
        "response.content_part.added") < kinds.index("response.output_audio.delta")
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]
    audio = audio_of(events)
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert audio.size > 0 and transcript
    assert done.response.status == "completed"
    assert done.response.output[0].content[0].transcript == transcript
    usage = done.response.usage
    assert usage.output_token_details.audio_tokens == -(-audio.size // 1920)
    assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    seconds_until_idle(triton_server.metrics_url, timeout_s=60.0)
