"""The whole served pipeline over Triton's gRPC stream: omni ensemble -> orchestrator (BLS) -> thinker ->
talker -> code2wav, against the in-process pipeline and transformers on the same tiny checkpoint."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from omni_triton.client import OmniStreamClient

pytestmark = pytest.mark.server

SAMPLES_PER_FRAME, FRAME_TRIM = 1920, 555  # one-pass decode of N frames: N * 1920 - 555 samples
# repetition_penalty 1.0: HF generate applies none to the thinker unless generation_config.json sets one
GREEDY = dict(temperature=0.0, repetition_penalty=1.0, max_tokens=12, max_audio_frames=20)
PROMPTS = ["Hello, how are you today?", "Tell me a story.", "What is the weather like in Paris?",
           "Numbers: 1 2 3", "Speech synthesis", "Once upon a time", "The quick brown fox", "Sing for me",
           "Please be brief.", "A robot learns.", "Streaming audio", "Good morning!", "ok", "Why?",
           "Tell me about codecs and sound.", "Thank you"]


def stream(server, text: str, audio_in=None, **scalars):
    with OmniStreamClient(server.grpc_url) as client:
        return client.stream(text, audio_in, timeout_s=120, **scalars)


@pytest.fixture(scope="module")
def inprocess(tiny_checkpoint):
    from omni_triton.pipeline.inprocess import InProcessPipeline

    pipeline = InProcessPipeline(tiny_checkpoint)
    yield pipeline
    pipeline.close()


def inprocess_run(pipeline, text: str, audio_in=None, **scalars) -> tuple[str, np.ndarray]:
    from omni_triton.client import build_inputs

    inputs = {tensor.name(): _array(tensor) for tensor in build_inputs(text, audio_in, **scalars)}
    return pipeline.generate(inputs)


def _array(tensor) -> np.ndarray:
    # build_inputs returns tritonclient InferInputs; their raw content is what the server receives
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    raw = tensor._raw_content
    if tensor.datatype() == "BYTES":
        return deserialize_bytes_tensor(raw).reshape(tensor.shape())
    return np.frombuffer(raw, dtype=triton_to_np_dtype(tensor.datatype())).reshape(tensor.shape())


def metrics(server) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = {}
    for name, stage, value in re.findall(r'^(omni_\w+)\{stage="(\w+)"\} (\S+)$', text, re.M):
        values[(name, stage)] = float(value)
    return values


def wait_idle(server, timeout_s: float = 5.0, read=metrics) -> dict:
    """Poll the stage gauges (``read(server)``: {(name, labels): value}) until nothing is held anywhere (or fail
    with what is still held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = read(server)
        held = {key: v for key, v in values.items()
                if key[0] in ("omni_active_requests", "omni_kv_blocks_used", "omni_pending_audio_frames",
                              "omni_code2wav_streams") and v}
        if not held and values:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"stages still hold state after {timeout_s} s: {held}")
        time.sleep(0.1)


def test_streamed_request_end_to_end(triton_server):
    result = stream(triton_server, "Hello, how are you today?", max_tokens=10, max_audio_frames=30,
                    min_audio_frames=30, ignore_eos=True, temperature=0.0)
    assert result.text and result.ttft_s is not None and result.ttfa_s is not None
    assert len(result.audio_chunks) >= 2, "audio must stream in several chunks"
    first_chunk_frames = 4  # LaunchConfig default: a small first chunk
    assert len(result.audio_chunks[0]) == first_chunk_frames * SAMPLES_PER_FRAME - FRAME_TRIM
    assert result.audio.size == 30 * SAMPLES_PER_FRAME - FRAME_TRIM
    assert np.abs(result.audio).max() <= 1.0 and result.audio.std() > 1e-3
    assert result.ttfa_s < result.total_s
    print(f"\nTTFT {result.ttft_s * 1e3:.0f} ms, TTFA {result.ttfa_s * 1e3:.0f} ms, RTF {result.rtf:.3f}")


def test_greedy_over_triton_equals_inprocess_and_transformers(triton_server, inprocess, tiny_checkpoint):
    served = stream(triton_server, PROMPTS[0], **GREEDY)
    text, audio = inprocess_run(inprocess, PROMPTS[0], **GREEDY)
    assert served.text == text
    # both pace their chunks by the clock (adaptive): other cuts round differently, up to ~4e-5 on the tiny
    # checkpoint (pipeline/code2wav/chunking.py), so the tests' 1e-4
    np.testing.assert_allclose(served.audio, audio, atol=1e-4)

    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_triton.pipeline.chat import ChatTokenizer

    chat = ChatTokenizer.from_checkpoint(tiny_checkpoint)
    prompt = torch.tensor([chat.encode_prompt(PROMPTS[0])])
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    sequences, waveform = model.generate(
        prompt, speaker="ethan", return_audio=True, thinker_do_sample=False, talker_do_sample=False,
        thinker_max_new_tokens=GREEDY["max_tokens"], talker_max_new_tokens=GREEDY["max_audio_frames"] + 1,
        thinker_eos_token_id=list(inprocess.thinker.eos_token_ids))
    reference_text = chat.tokenizer.decode(sequences[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)
    assert served.text == reference_text
    reference_audio = waveform.reshape(-1).numpy()
    assert served.audio.shape == reference_audio.shape
    # streamed with exact left context vs HF's one-pass decode: equal up to float32 rounding
    np.testing.assert_allclose(served.audio, reference_audio, atol=1e-4)


def test_sequential_mode_gives_the_streaming_result(triton_server):
    streamed = stream(triton_server, PROMPTS[1], **GREEDY)
    sequential = stream(triton_server, PROMPTS[1], sequential=True, **GREEDY)
    assert sequential.text == streamed.text
    assert len(sequential.audio_chunks) == 1
    np.testing.assert_allclose(sequential.audio, streamed.audio, atol=1e-4)


def test_audio_input_request(triton_server, inprocess):
    seconds = np.arange(int(1.3 * 16000)) / 16000
    chirp = (0.3 * np.sin(2 * np.pi * (200 + 300 * seconds) * seconds)).astype(np.float32)
    served = stream(triton_server, "What did I say?", chirp, **GREEDY)
    assert served.audio.size > 0 and served.text
    text, audio = inprocess_run(inprocess, "What did I say?", chirp, **GREEDY)
    assert served.text == text
    np.testing.assert_allclose(served.audio, audio, atol=1e-4)  # chunk cuts by the clock, as above
    # the spoken input changes the answer: the same text without it differs
    assert stream(triton_server, "What did I say?", **GREEDY).audio.tobytes() != served.audio.tobytes()


def check_concurrent_streams(server, pipeline) -> None:
    """Every prompt at once over ``server``: each stream gets what the in-process ``pipeline`` gives alone."""
    alone = [inprocess_run(pipeline, prompt, **GREEDY) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda prompt: stream(server, prompt, **GREEDY), PROMPTS))
    for prompt, result, (text, audio) in zip(PROMPTS, served, alone):
        assert result.text == text, prompt
        np.testing.assert_allclose(result.audio, audio, atol=1e-4, err_msg=prompt)


def test_concurrent_streams_each_get_their_own_output(triton_server, inprocess):
    check_concurrent_streams(triton_server, inprocess)
    # seeded sampling: two concurrent requests with one seed agree, another seed differs
    sampled = dict(temperature=0.9, top_k=20, max_tokens=12, max_audio_frames=12)
    with ThreadPoolExecutor(3) as pool:
        a, b, c = pool.map(lambda seed: stream(triton_server, PROMPTS[2], seed=seed, **sampled), [7, 7, 8])
    assert a.text == b.text  # same codes; code2wav may batch their chunks differently, hence allclose
    np.testing.assert_allclose(a.audio, b.audio, atol=1e-4)
    assert (a.text, a.audio.tobytes()) != (c.text, c.audio.tobytes())
    wait_idle(triton_server)


def test_text_only_requests_never_touch_talker_or_code2wav(triton_server):
    with triton_server.grpc_client() as client:
        def counts():
            return {model: client.get_inference_statistics(model).model_stats[0].inference_count
                    for model in ("thinker", "talker", "code2wav")}

        before = counts()
        result = stream(triton_server, PROMPTS[3], return_audio=False, max_tokens=8, temperature=0.0)
        after = counts()
    assert result.text and not result.audio_chunks
    assert after["thinker"] > before["thinker"]
    assert after["talker"] == before["talker"] and after["code2wav"] == before["code2wav"]


@pytest.mark.parametrize("field, scalars, text", [
    ("TEXT", {}, ""),
    ("MAX_TOKENS", {"max_tokens": 0}, "hi"),
    ("MAX_TOKENS", {"max_tokens": 10**9}, "hi"),
    ("SPEAKER", {"speaker": "nobody"}, "hi"),
    ("TEMPERATURE", {"temperature": float("nan")}, "hi"),
    ("TEMPERATURE", {"temperature": -1.0}, "hi"),
    ("TEXT", {}, "x" * 10_000),
])
def test_bad_input_is_an_error_naming_the_field(triton_server, field, scalars, text):
    with pytest.raises(InferenceServerException) as error:
        stream(triton_server, text, **scalars)
    assert error.value.code == "INVALID_ARG" and field in error.value.message()
    assert stream(triton_server, "still fine?", max_tokens=4, max_audio_frames=4, temperature=0.0).audio.size


def cancel_at_first_audio(server, text: str, **scalars) -> None:
    """Stream ``text`` and cancel it (``OmniStreamClient.cancel``) as its first audio arrives; it must fail."""
    client = OmniStreamClient(server.grpc_url)
    first_audio = []
    try:
        with pytest.raises(Exception):
            client.stream(text, on_audio=lambda chunk: (first_audio.append(chunk), client.cancel()), **scalars)
    finally:
        client.client.close()
    assert first_audio, "the request was cancelled before it produced audio"


def test_client_cancel_frees_every_stage(triton_server):
    cancel_at_first_audio(triton_server, "Tell me a very long story.", max_tokens=60, max_audio_frames=400,
                          min_audio_frames=400, ignore_eos=True, temperature=0.0, timeout_s=5)
    values = wait_idle(triton_server, timeout_s=5.0)
    assert values[("omni_kv_blocks_free", "thinker")] > 0 and values[("omni_kv_blocks_free", "talker")] > 0
    # and the server keeps serving
    assert stream(triton_server, "after cancel", max_tokens=4, max_audio_frames=4, temperature=0.0).audio.size


def test_client_deadline_ends_a_long_request(triton_server):
    with pytest.raises(InferenceServerException, match=r"deadline_s 0.5 s exceeded"):
        stream(triton_server, "A long answer, please.", max_tokens=60, max_audio_frames=400, min_audio_frames=400,
               ignore_eos=True, temperature=0.0, deadline_s=0.5)
    wait_idle(triton_server)


def test_inprocess_stateful_audio_equals_exact_context(inprocess, tiny_checkpoint):
    """The in-process pipeline with stateful chunks (the bench's in-process runner uses the launch default) gives
    the audio of exact left context, and frees each request's vocoder state."""
    from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
    from omni_triton.pipeline.inprocess import InProcessPipeline

    stateful = InProcessPipeline(tiny_checkpoint, policy=ChunkPolicy(stateful=True))
    try:
        text, audio = inprocess_run(stateful, PROMPTS[2], **GREEDY)
        assert stateful.streams.open_streams == 0
    finally:
        stateful.close()
    expected_text, expected_audio = inprocess_run(inprocess, PROMPTS[2], **GREEDY)
    assert text == expected_text and audio.size and audio.shape == expected_audio.shape
    np.testing.assert_allclose(audio, expected_audio, atol=1e-4)
