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

from omni_triton.api.realtime.limits import RealtimeLimits  # noqa: E402
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


# A reply the server bounds to this much audio (random weights: an unbounded one speaks until the talker
# happens to stop, 1-10 s of CPU time here): for the tests whose point is not the reply's length. The unbounded
# path keeps its own tests (a text turn, barge-in, a client that leaves).
BRIEF_AUDIO_S = 1.0


@pytest.fixture(scope="module")
def brief_api(triton_server):
    with ApiServer(triton_server.grpc_url, triton_server.checkpoint_dir,
                   realtime_limits=RealtimeLimits(max_output_audio_s=BRIEF_AUDIO_S)) as server:
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


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def raw_turn(socket, session: dict, text: str, until_kind: str) -> dict:
    """Over a raw WebSocket: set ``session``, add a user text item, ask for a reply; its first ``until_kind``."""
    for event in ({"type": "session.update", "session": session},
                  {"type": "conversation.item.create", "item": user_text(text)}, {"type": "response.create"}):
        await socket.send(json.dumps(event))
    async with asyncio.timeout(EVENT_TIMEOUT_S):
        while (event := json.loads(await socket.recv()))["type"] != until_kind:
            assert event["type"] != "error", event
    return event


def raw_url(api) -> str:
    return api.url.replace("http", "ws") + "/v1/realtime?model=omni"


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
            await connection.conversation.item.create(item=user_text("Hello, how are you?"))
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


# -- turns by server VAD, and by a manual commit ----------------------------------------------------------

def test_spoken_turn_by_server_vad(brief_api, speech):
    async def scenario():
        async with async_client(brief_api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": VAD}},
                                                     **SHORT})
            await until(connection, "session.updated")
            await send_audio(connection, utterance(speech))
            events: list = []
            await until(connection, "response.done", events)
            return events

    events = run(scenario())
    kinds = [e.type for e in events]
    started, stopped, committed = (next(e for e in events if e.type == kind) for kind in (
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"))
    assert kinds.index(started.type) < kinds.index(stopped.type) < kinds.index(committed.type) < kinds.index(
        "response.created")
    speech_ms = speech.size * 1000 // 16000
    # the speech lies between 1000 ms and 1000 + speech_ms of the input: started (less the prefix padding) before
    # its onset is heard, stopped after its last word and before the trailing silence ends
    assert 1000 - VAD["prefix_padding_ms"] - 100 <= started.audio_start_ms <= 1000 + 300
    assert 1000 + speech_ms // 2 <= stopped.audio_end_ms <= 2000 + speech_ms
    assert started.item_id == stopped.item_id == committed.item_id
    user_item = next(e.item for e in events if e.type == "conversation.item.added" and e.item.role == "user")
    assert user_item.id == committed.item_id and user_item.content[0].type == "input_audio"
    done = events[-1]
    assert done.response.status == "completed" and audio_of(events).size > 0
    # the committed audio (from the speech's start less the padding) is in the prompt: its audio pads count
    assert done.response.usage.input_tokens > 20


def test_manual_commit_then_response(api, speech):
    async def scenario():
        async with async_client(api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            await connection.session.update(session={"type": "realtime",
                                                     "audio": {"input": {"turn_detection": None}}, **SHORT})
            await until(connection, "session.updated")
            await connection.input_audio_buffer.commit()  # nothing buffered yet
            empty = await until(connection, "error")
            await send_audio(connection, pcm16_24k(speech))
            await connection.input_audio_buffer.commit()
            events: list = []
            committed = await until(connection, "input_audio_buffer.committed", events)
            await connection.response.create(response={"output_modalities": ["text"]})
            await until(connection, "response.done", events)
            return empty, committed, events

    empty, committed, events = run(scenario())
    assert empty.error.code == "input_audio_buffer_commit_empty" and empty.error.param == "input_audio_buffer"
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" not in kinds, "turn detection is off"
    assert "response.output_audio.delta" not in kinds and "response.output_text.delta" in kinds
    done = events[-1]
    assert done.response.status == "completed" and done.response.output_modalities == ["text"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.response.output[0].content[0].text == text



# -- barge-in, truncate, conversations --------------------------------------------------------------------

async def wait_for_cancel(bridge, response_id: str) -> None:
    async with asyncio.timeout(60):  # a hang guard
        while response_id not in bridge.cancelled:
            await asyncio.sleep(0.05)


def test_barge_in_cancels_the_reply_and_the_next_turn_uses_the_truncated_history(api, triton_server, speech):
    """Speech while the reply plays cancels it (Triton request cancelled, every stage idle); the client truncates
    the reply to what it played; the next response's prompt holds the truncated reply."""
    bridge = api.app.state.bridge

    async def scenario():
        async with async_client(api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            vad = dict(VAD, create_response=False)  # the next turn is asked for once the stages are checked
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": vad}},
                                                     **LONG_ANSWER})
            await until(connection, "session.updated")
            await connection.conversation.item.create(item=user_text("Tell me a long story."))
            await connection.response.create()
            reply: list = []
            first = await until(connection, "response.output_audio.delta", reply)
            # and a second chunk: a reply cancelled at its first may hold one text token, which no truncation can
            # shorten (CI saw heard == generated == one token)
            await until(connection, "response.output_audio.delta", reply)
            await send_audio(connection, utterance(speech, silence_s=0.0) + bytes(24000 * 2))  # talk over it
            await until(connection, "input_audio_buffer.speech_started", reply)
            done = await until(connection, "response.done", reply)
            await wait_for_cancel(bridge, done.response.id)
            await asyncio.to_thread(seconds_until_idle, triton_server.metrics_url, 60.0)  # every stage freed it
            spoken = await until(connection, "conversation.item.added")  # the user's speech, committed by the VAD
            # the client played part of what it got: at most half (a reply cancelled early may have sent under
            # 400 ms, and all of it would be all of its text)
            played_ms = min(400, audio_of(reply).size * 1000 // 24000 // 2)
            await connection.conversation.item.truncate(item_id=first.item_id, content_index=0, audio_end_ms=played_ms)
            truncated = await until(connection, "conversation.item.truncated")
            await connection.conversation.item.retrieve(item_id=first.item_id)
            kept = await until(connection, "conversation.item.retrieved")
            # the next turn: text in place of the speech, so the test knows the whole prompt
            await connection.conversation.item.delete(item_id=spoken.item.id)
            await until(connection, "conversation.item.deleted")
            await connection.conversation.item.create(item=user_text("And then?"))
            await connection.response.create(response={"max_output_tokens": 6})
            after: list = []
            next_done = await until(connection, "response.done", after)
            return reply, done, played_ms, truncated, kept, next_done, after

    reply, done, played_ms, truncated, kept, next_done, after = run(scenario())
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
    sent_transcript = done.response.output[0].content[0].transcript
    generated = "".join(e.delta for e in reply if e.type == "response.output_audio_transcript.delta")
    assert generated.startswith(sent_transcript), "the cancelled reply keeps the text its audio spoke"
    assert (truncated.item_id, truncated.audio_end_ms) == (done.response.output[0].id, played_ms)
    heard = kept.item.content[0].transcript
    assert sent_transcript.startswith(heard) and len(heard) < len(generated)
    assert next_done.response.status == "completed" and audio_of(after).size > 0
    # the next prompt: the user's text, the reply as heard, the new turn
    from omni_triton.api.usage import TokenCounter

    history = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": heard}]
    prompt = TokenCounter(triton_server.checkpoint_dir).usage("And then?", 0, "", 0, history).prompt_tokens
    assert next_done.response.usage.input_tokens == prompt


def test_five_turn_conversation_renders_the_history(api, triton_server):
    """Five text turns: each prompt is the instructions, every earlier turn and the reply as sent (the API's
    usage counts the prompt it sent; here it is rebuilt from the events)."""
    from omni_triton.api.usage import TokenCounter

    counter = TokenCounter(triton_server.checkpoint_dir)
    questions = ["Hi there.", "What is the weather like?", "And in Paris?", "Tell me a story.", "Thank you."]

    async def scenario():
        async with async_client(api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            # text replies: quick on the CPU, and the history is the same text either way
            await connection.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                                     "output_modalities": ["text"],
                                                     "audio": {"input": {"turn_detection": None}}, **SHORT})
            await until(connection, "session.updated")
            turns = []
            for question in questions:
                await connection.conversation.item.create(item=user_text(question))
                await connection.response.create()
                turns.append(await until(connection, "response.done"))
            return turns

    turns = run(scenario())
    history = [{"role": "system", "content": "Be brief."}]
    for question, done in zip(questions, turns):
        assert done.response.status == "completed"
        assert done.response.usage.input_tokens == counter.usage(question, 0, "", 0, history).prompt_tokens
        history += [{"role": "user", "content": question},
                    {"role": "assistant", "content": done.response.output[0].content[0].text}]


def test_history_longer_than_the_context_is_an_error_naming_the_conversation(api):
    """The test server's context is 512 tokens: two long items overflow it; the model server refuses the
    prompt (its HISTORY input) and the error names the conversation; the session goes on."""
    long_text = " ".join(str(i) for i in range(200))[:480]  # ~300 tokens, within the 500-character item limit

    async def scenario():
        async with async_client(api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            await connection.session.update(session={"type": "realtime", **SHORT})
            for role, kind in (("user", "input_text"), ("assistant", "output_text")):
                await connection.conversation.item.create(item={"type": "message", "role": role,
                                                                "content": [{"type": kind, "text": long_text}]})
            await connection.conversation.item.create(item=user_text("hi"))
            await connection.response.create()
            events: list = []
            async with asyncio.timeout(EVENT_TIMEOUT_S):
                while not events or events[-1].type != "response.done":
                    events.append(await connection.recv())
            return events

    events = run(scenario())
    error = next(e for e in events if e.type == "error").error
    assert error.param == "conversation" and "too long" in error.message, error
    assert events[-1].response.status == "failed"


# -- bad events, limits, several sessions, a client that goes away ------------------------------------------

BAD_EVENTS = [
    ({"type": "session.create"}, "type", "invalid_event"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 2}}}}}, "session.audio.input.turn_detection.threshold", "invalid_value"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}},
     "session.audio.input.format.type", "invalid_value"),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}, "session.tools",
     "invalid_value"),
    ({"type": "session.update", "session": {"model": "gpt-realtime"}}, "session.model", "invalid_value"),
    ({"type": "session.update", "session": {"temperature": 0.7}}, "session.temperature", "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio", "invalid_value"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                   "content": [{"type": "input_text", "text": "x"}]}},
     "item.content[0].type", "invalid_value"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}},
     "item.content", "invalid_value"),
    ({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 10},
     "item_id", "item_not_found"),
    ({"type": "conversation.item.delete", "item_id": "item_nope"}, "item_id", "item_not_found"),
    ({"type": "response.cancel"}, "response_id", "response_cancel_not_active"),
    ({"type": "response.create"}, "conversation", "no_user_turn"),
    ({"type": "response.create", "response": {"output_modalities": ["audio", "text"]}},
     "response.output_modalities", "invalid_value"),
]


def test_bad_events_are_errors_naming_the_field_and_the_session_goes_on(brief_api):
    import websockets

    async def scenario():
        async with websockets.connect(raw_url(brief_api)) as socket:
            assert json.loads(await socket.recv())["type"] == "session.created"
            errors = []
            for index, (event, _, _) in enumerate(BAD_EVENTS):
                await socket.send(json.dumps({**event, "event_id": f"bad_{index}"}))
                answer = json.loads(await socket.recv())
                assert answer["type"] == "error", (event, answer)
                errors.append(answer["error"])
            await socket.send("{not json")
            not_json = json.loads(await socket.recv())["error"]
            # still usable: a turn is answered
            return errors, not_json, await raw_turn(socket, SHORT, "hi", "response.done")

    errors, not_json, done = run(scenario())
    for index, ((event, param, code), error) in enumerate(zip(BAD_EVENTS, errors)):
        assert (error["param"], error["code"], error["event_id"]) == (param, code, f"bad_{index}"), (event, error)
        assert error["type"] == "invalid_request_error" and error["message"], error
    assert not_json["code"] == "invalid_json"
    assert done["response"]["status"] == "completed"


def test_two_sessions_at_once(brief_api):
    async def one_session(text: str):
        async with async_client(brief_api).realtime.connect(model="omni") as connection:
            await until(connection, "session.created")
            await connection.session.update(session={"type": "realtime", **SHORT})
            await connection.conversation.item.create(item=user_text(text))
            await connection.response.create()
            events: list = []
            await until(connection, "response.done", events)
            return events

    async def both():
        return await asyncio.gather(one_session("Hello there."), one_session("What time is it?"))

    first, second = run(both())
    for events in (first, second):
        assert events[-1].response.status == "completed" and audio_of(events).size > 0
    ids = {e.response_id for events in (first, second) for e in events if e.type == "response.output_audio.delta"}
    assert len(ids) == 2, "each session got its own response's audio only"


def test_client_that_disconnects_mid_response_cancels_it(api, triton_server):
    import websockets

    bridge = api.app.state.bridge

    async def scenario():
        async with websockets.connect(raw_url(api)) as socket:
            event = await raw_turn(socket, LONG_ANSWER, "A long story.", "response.output_audio.delta")
        await wait_for_cancel(bridge, event["response_id"])  # the socket is closed: the API cancels the request

    run(scenario())
    seconds_until_idle(triton_server.metrics_url, timeout_s=60.0)


def test_unknown_model_is_refused(api):
    async def scenario():
        async with async_client(api).realtime.connect(model="gpt-realtime") as connection:
            return await connection.recv()

    error = run(scenario())
    assert error.type == "error" and error.error.code == "model_not_found" and error.error.param == "model"


def test_session_limits(triton_server):
    """A conversation holds at most max_items; a session without client events ends after idle_timeout_s, a busy
    one at max_session_s; each gets an error event and is closed."""
    import websockets

    limits = RealtimeLimits(max_items=2, idle_timeout_s=1.0, max_session_s=3.0)
    with ApiServer(triton_server.grpc_url, realtime_limits=limits) as small:
        async def idle():
            async with async_client(small).realtime.connect(model="omni") as connection:
                await until(connection, "session.created")
                for text in ("one", "two", "three"):
                    await connection.conversation.item.create(item=user_text(text))
                full = await until(connection, "error")
                idle = await until(connection, "error")  # nothing more sent: the session times out
                with pytest.raises(Exception):
                    await connection.recv()  # and is closed
                return full, idle

        async def busy():
            async with async_client(small).realtime.connect(model="omni") as connection:
                await until(connection, "session.created")
                for _ in range(60):  # a hang guard: the session ends after 3 s
                    try:
                        await connection.input_audio_buffer.clear()
                    except websockets.ConnectionClosed:  # closed while we slept: its error came before
                        return await until(connection, "error")
                    event = await connection.recv()
                    if event.type == "error":
                        return event
                    await asyncio.sleep(0.2)

        async def both():
            return await asyncio.gather(idle(), busy())

        (full, idle), expired = run(both())
    assert full.error.code == "conversation_too_long" and full.error.param == "item"
    assert idle.error.code == "idle_timeout" and expired.error.code == "session_expired"


def test_reply_audio_is_bounded_by_the_server_limit(triton_server):
    """``--realtime-max-output-audio-s``: a reply that would speak longer stops at that many codec frames.

    The talker samples (the realtime API sends no seed), so a reply may end on its own before the bound: each
    reply stays within it, and of a few replies one that speaks on is cut at exactly the bound."""
    with ApiServer(triton_server.grpc_url, triton_server.checkpoint_dir,
                   realtime_limits=RealtimeLimits(max_output_audio_s=0.4)) as bounded:
        async def scenario():
            replies = []
            async with async_client(bounded).realtime.connect(model="omni") as connection:
                await until(connection, "session.created")
                await connection.session.update(session={"type": "realtime", **LONG_ANSWER,
                                                          "audio": {"input": {"turn_detection": None}}})
                await until(connection, "session.updated")
                for _ in range(4):
                    await connection.conversation.item.create(item=user_text("Tell me a long story."))
                    await connection.response.create()
                    events: list = []
                    done = await until(connection, "response.done", events)
                    replies.append((done, audio_of(events)))
                    if done.response.usage.output_token_details.audio_tokens == 5:
                        break
            return replies

        replies = run(scenario())
    for done, audio in replies:
        assert done.response.status == "completed"
        frames = done.response.usage.output_token_details.audio_tokens
        assert frames <= 5  # 0.4 s at 12.5 frames a second
        assert audio.size == (frames * 1920 - 555 if frames else 0)  # N frames decode to 1920 N - 555 samples
    assert replies[-1][0].response.usage.output_token_details.audio_tokens == 5, "no reply reached the bound"


def test_beta_client_dialect(brief_api):
    """The official client's beta path (``OpenAI-Beta: realtime=v1``): flat session fields, beta event names."""
    async def scenario():
        # the beta path takes wss:// unless told the WebSocket address
        client = openai.AsyncOpenAI(base_url=brief_api.url + "/v1",
                                    websocket_base_url=raw_url(brief_api).split("/realtime")[0],
                                    api_key="not-checked", max_retries=0)
        async with client.beta.realtime.connect(model="omni") as connection:
            created = await until(connection, "session.created")
            await connection.session.update(session={"modalities": ["text", "audio"], "voice": "chelsie",
                                                     "input_audio_format": "pcm16", "turn_detection": None,
                                                     "max_response_output_tokens": 6})
            updated = await until(connection, "session.updated")
            await connection.conversation.item.create(item=user_text("Hello!"))
            await until(connection, "conversation.item.created")
            await connection.response.create()
            events: list = []
            await until(connection, "response.done", events)
            return created, updated, events

    created, updated, events = run(scenario())
    assert created.session.modalities == ["text", "audio"] and created.session.output_audio_format == "pcm16"
    assert updated.session.voice == "chelsie" and updated.session.turn_detection is None
    kinds = {e.type for e in events}
    assert {"response.audio.delta", "response.audio_transcript.delta", "response.audio.done",
            "response.audio_transcript.done"} <= kinds
    assert not any(kind.startswith("response.output_audio") or kind.startswith("conversation.item.added")
                   for kind in kinds)
    done = events[-1].response
    assert done.status == "completed" and done.output[0].content[0].type == "audio"
    audio = [e for e in events if e.type == "response.audio.delta"]
    assert audio and base64.b64decode(audio[0].delta)
