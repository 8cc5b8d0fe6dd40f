"""Prefix caching served (``serve --prefix-caching on|off``), two real tritonservers on the tiny checkpoint: over a
multi-turn conversation with text and spoken turns, and requests sharing a system prompt, the served text and
audio with the cache on are those with it off, and the hits show in the metrics of both engines."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_LIMITS
from omni_triton.client import OmniStreamClient, build_inputs, infer_inputs
from omni_triton.pipeline.chat import ChatTokenizer
from omni_triton.stages.orchestrator import REQUEST_INPUTS
from omni_triton.shared.settings import STAGES, LaunchConfig
from reliability_helpers import read_gauges, seconds_until_idle
from server_fixture import start_servers

pytestmark = pytest.mark.server

TURN = dict(max_tokens=8, max_audio_frames=10, temperature=0.0, repetition_penalty=1.0)
SYSTEM = {"role": "system", "content": [{"type": "text", "text": "You are a patient assistant who answers in "
                                                                 "short sentences and speaks clearly. " * 3}]}
# (user text, spoken): the spoken turn's recording stays in the conversation, so the turn after repeats it
TURNS = [("Hello, who are you?", False), ("What did I just say?", True), ("Say it once more, slowly.", False)]


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    """Cache off and on; audio chunks of fixed sizes (not cut by the clock), so one stream's audio is exact."""
    runs = [(LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          prefix_caching=caching, chunk_pacing="ramp", **TEST_LIMITS),
             tmp_path_factory.mktemp(f"prefix-caching-{caching}")) for caching in (False, True)]
    handles = dict(zip((False, True), start_servers(runs)))
    try:
        yield handles
    finally:
        for handle in handles.values():
            handle.stop_after_tests()


@pytest.fixture(scope="module")
def chat(tiny_checkpoint):
    return ChatTokenizer.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def spoken(servers, chat):
    """The scalar inputs of a turn and a recording's log-mel features (from preprocess), its audio-token count."""
    seconds = np.arange(16000, dtype=np.float32) / 16000
    chirp = (0.3 * np.sin(2 * np.pi * (200 + 300 * seconds) * seconds)).astype(np.float32)
    with grpcclient.InferenceServerClient(servers[False].grpc_url) as client:
        prepared = client.infer("preprocess", build_inputs("x", chirp, **TURN))
    ids = prepared.as_numpy("INPUT_IDS")
    arrays = {name: prepared.as_numpy(name) for name in REQUEST_INPUTS if name not in ("INPUT_IDS", "CONTROL")}
    return arrays, int((ids == chat.audio_token_id).sum())


def send(server, prompt_ids: list[int], arrays: dict[str, np.ndarray], spoken_turns: bool):
    """One turn straight to the orchestrator (its prompt ids made here: the omni model takes one user turn)."""
    arrays = dict(arrays, INPUT_IDS=np.asarray(prompt_ids, np.int64))
    if not spoken_turns:
        arrays["AUDIO_FEATURES"] = np.zeros((128, 0), np.float32)
    with OmniStreamClient(server.grpc_url, model="orchestrator") as client:
        return client.stream_inputs(infer_inputs(arrays), timeout_s=120)


def user(text: str, with_audio: bool) -> dict:
    parts = [{"type": "audio", "audio": "<ndarray>"}] if with_audio else []
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def converse(server, chat: ChatTokenizer, spoken) -> list:
    arrays, num_audio_tokens = spoken
    messages, results, any_audio = [SYSTEM], [], False
    for text, with_audio in TURNS:
        messages.append(user(text, with_audio))
        any_audio = any_audio or with_audio
        result = send(server, chat.encode_messages(messages, num_audio_tokens if any_audio else 0), arrays, any_audio)
        results.append(result)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": result.text}]})
    return results


def prefix_hits(server) -> dict[str, float]:
    seconds_until_idle(server.metrics_url, timeout_s=30)
    gauges = read_gauges(server.metrics_url)
    return {stage: gauges[("omni_prefix_cache_hit_tokens", stage)] for stage in ("thinker", "talker")}


def test_a_conversation_with_spoken_turns_is_served_as_with_the_cache_off(servers, chat, spoken):
    before = prefix_hits(servers[True])
    off, on = converse(servers[False], chat, spoken), converse(servers[True], chat, spoken)
    for turn, (a, b) in enumerate(zip(off, on)):
        assert a.text == b.text, turn
        assert a.audio.size > 0 and np.array_equal(a.audio, b.audio), turn
    hits = prefix_hits(servers[True])
    # later turns repeat the system prompt and the earlier turns, the spoken one's audio rows included
    assert hits["thinker"] - before["thinker"] >= 64 and hits["talker"] > before["talker"]
    assert prefix_hits(servers[False]) == {"thinker": 0, "talker": 0}


def test_requests_sharing_a_system_prompt_are_served_as_with_the_cache_off(servers, chat, spoken):
    arrays, _ = spoken
    prompts = [chat.encode_messages([SYSTEM, user(f"Question number {i}: why?", False)]) for i in range(4)]

    def served(server) -> list:
        first = send(server, prompts[0], arrays, False)  # computes the system prompt
        with ThreadPoolExecutor(3) as pool:
            return [first, *pool.map(lambda ids: send(server, ids, arrays, False), prompts[1:])]

    before = prefix_hits(servers[True])["thinker"]
    for a, b in zip(served(servers[False]), served(servers[True])):
        assert a.text == b.text  # the same codes; code2wav may batch concurrent streams' chunks differently
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-4)
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    block = LaunchConfig.kv_block_size
    assert prefix_hits(servers[True])["thinker"] - before >= 3 * (shared // block) * block > 0
