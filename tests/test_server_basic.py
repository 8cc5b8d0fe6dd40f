"""A real tritonserver on the tiny checkpoint: startup, preprocess (tokens, features, validation), code2wav."""

from __future__ import annotations

import json
import math
import queue
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_LIMITS

pytestmark = pytest.mark.server


DECOUPLED_MODELS = ("code2wav",)  # answered on a stream: one final response per request


def infer(client, model: str, **tensors):
    inputs = []
    for name, value in tensors.items():
        array = np.asarray(value)
        datatype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return infer_one(client, model, inputs)


def infer_one(client, model: str, inputs: list, timeout_s: float = 120.0):
    """One request's one result, over a stream for a decoupled model; errors raise InferenceServerException."""
    if model not in DECOUPLED_MODELS:
        return client.infer(model, inputs)
    results: queue.Queue = queue.Queue()
    # the header makes a streamed error carry its gRPC code (else status() is None)
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer(model, inputs)
        result, error = results.get(timeout=timeout_s)
    finally:
        client.stop_stream()
    if error is not None:
        raise error
    return result


def text(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


@pytest.fixture(scope="module")
def client(triton_server):
    with triton_server.grpc_client() as grpc:
        yield grpc


@pytest.fixture(scope="module")
def checkpoint_config(triton_server) -> dict:
    return json.loads((triton_server.checkpoint_dir / "config.json").read_text())


def test_server_ready_with_metrics(triton_server, client):
    assert client.is_server_live() and client.is_server_ready()
    for model in ("preprocess", "code2wav"):
        assert model in triton_server.models and client.is_model_ready(model)
    metrics = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
    assert "nv_inference_request_success" in metrics
    print(f"\nready in {triton_server.ready_s:.1f} s, tritonserver + stubs RSS "
          f"{triton_server.rss_bytes() / 2**20:.0f} MiB, models {triton_server.models}")


def test_the_model_stages_keep_their_loaded_objects_out_of_collection(triton_server, client):
    """--stage-gc-freeze (on by default): each stage process that serves streams froze what its loading left (its
    log line)."""
    assert client.is_server_ready()
    log = triton_server.server.log_path.read_text(errors="replace")
    for stage in ("thinker", "talker", "code2wav", "orchestrator"):
        frozen = re.search(rf"^{stage}: (\d+) objects from loading kept out of garbage collection", log, re.M)
        assert frozen, f"no freeze line from the {stage} stage in {triton_server.server.log_path}"
        assert int(frozen.group(1)) > 10_000  # a loaded torch stage: the model's and torch's own objects


def hf_prompt_ids(checkpoint_dir, content) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("prompt", ["Hello, how are you today?", "héllo wörld ✓ 你好", " spaces  and\nnewlines "])
def test_preprocess_input_ids_match_the_tokenizer_chat_template(triton_server, client, checkpoint_config, prompt):
    result = infer(client, "preprocess", TEXT=text(prompt))
    expected = hf_prompt_ids(triton_server.checkpoint_dir, [{"type": "text", "text": prompt}])
    assert result.as_numpy("INPUT_IDS").tolist() == expected
    assert result.as_numpy("AUDIO_FEATURES").shape == (128, 0)
    assert result.as_numpy("MAX_TOKENS").tolist() == [TEST_LIMITS["default_max_tokens"]]
    assert result.as_numpy("SPEAKER_ID").tolist() == [checkpoint_config["talker_config"]["speaker_id"]["ethan"]]
    assert result.as_numpy("RETURN_AUDIO").tolist() == [True]


def test_preprocess_passes_validated_scalars_through(client, checkpoint_config):
    result = infer(client, "preprocess", TEXT=text("hi"), SPEAKER=text("Chelsie"),
                   MAX_TOKENS=np.array([7], np.int32), MIN_TOKENS=np.array([3], np.int32),
                   TEMPERATURE=np.array([0.0], np.float32), TOP_P=np.array([1.0], np.float32),
                   TOP_K=np.array([5], np.int32), SEED=np.array([1234], np.int64),
                   RETURN_AUDIO=np.array([False]), IGNORE_EOS=np.array([True]),
                   MAX_AUDIO_FRAMES=np.array([40], np.int32), SEQUENTIAL=np.array([True]))
    assert result.as_numpy("SPEAKER_ID").tolist() == [checkpoint_config["talker_config"]["speaker_id"]["chelsie"]]
    assert result.as_numpy("MAX_TOKENS").tolist() == [7] and result.as_numpy("MIN_TOKENS").tolist() == [3]
    assert result.as_numpy("TEMPERATURE").tolist() == [0.0] and result.as_numpy("TOP_P").tolist() == [1.0]
    assert result.as_numpy("TOP_K").tolist() == [5] and result.as_numpy("SEED").tolist() == [1234]
    assert result.as_numpy("RETURN_AUDIO").tolist() == [False] and result.as_numpy("IGNORE_EOS").tolist() == [True]
    assert result.as_numpy("MAX_AUDIO_FRAMES").tolist() == [40] and result.as_numpy("SEQUENTIAL").tolist() == [True]


def test_preprocess_spoken_input_gets_features_and_audio_pads(triton_server, client, checkpoint_config):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    seconds = 1.5
    t = np.arange(int(16000 * seconds)) / 16000
    waveform = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    result = infer(client, "preprocess", TEXT=text("what is this?"), AUDIO_IN=waveform)
    features = result.as_numpy("AUDIO_FEATURES")
    assert features.shape == (128, int(16000 * seconds) // 160) and np.isfinite(features).all()
    audio_pad = checkpoint_config["thinker_config"]["audio_token_id"]
    num_pads = int(_get_feat_extract_output_lengths(torch.tensor(features.shape[1])))
    ids = result.as_numpy("INPUT_IDS").tolist()
    assert ids.count(audio_pad) == num_pads
    # the same prompt as the HF template renders it, with its single audio pad expanded
    reference = hf_prompt_ids(triton_server.checkpoint_dir,
                              [{"type": "audio", "audio": "<audio>"}, {"type": "text", "text": "what is this?"}])
    at = reference.index(audio_pad)
    assert ids == reference[:at] + [audio_pad] * num_pads + reference[at + 1:]


TOO_LONG_TOKENS = "word " * 90  # under the character limit, over the 512-token context with MAX_TOKENS 64
BAD_REQUESTS = {
    "empty text": ("TEXT", dict(TEXT=text(""))),
    "whitespace text": ("TEXT", dict(TEXT=text("   "))),
    "text over the char limit": ("TEXT", dict(TEXT=text("a" * (TEST_LIMITS["max_text_chars"] + 1)))),
    "prompt over the context": ("TEXT", dict(TEXT=text(TOO_LONG_TOKENS * 3), MAX_TOKENS=np.array([64], np.int32))),
    "invalid utf-8": ("TEXT", dict(TEXT=text(b"caf\xc3("))),
    "two texts": ("TEXT", dict(TEXT=np.array([b"a", b"b"], dtype=np.object_))),
    "max tokens 0": ("MAX_TOKENS", dict(TEXT=text("hi"), MAX_TOKENS=np.array([0], np.int32))),
    "max tokens over cap": ("MAX_TOKENS", dict(TEXT=text("hi"), MAX_TOKENS=np.array([65], np.int32))),
    "max tokens as float": ("MAX_TOKENS", dict(TEXT=text("hi"), MAX_TOKENS=np.array([5.0], np.float32))),
    "min tokens over max": ("MIN_TOKENS", dict(TEXT=text("hi"), MAX_TOKENS=np.array([4], np.int32),
                                               MIN_TOKENS=np.array([5], np.int32))),
    "unknown speaker": ("SPEAKER", dict(TEXT=text("hi"), SPEAKER=text("bob"))),
    "nan temperature": ("TEMPERATURE", dict(TEXT=text("hi"), TEMPERATURE=np.array([math.nan], np.float32))),
    "negative temperature": ("TEMPERATURE", dict(TEXT=text("hi"), TEMPERATURE=np.array([-0.5], np.float32))),
    "top_p 0": ("TOP_P", dict(TEXT=text("hi"), TOP_P=np.array([0.0], np.float32))),
    "top_p over 1": ("TOP_P", dict(TEXT=text("hi"), TOP_P=np.array([1.5], np.float32))),
    "negative top_k": ("TOP_K", dict(TEXT=text("hi"), TOP_K=np.array([-1], np.int32))),
    "audio with nan": ("AUDIO_IN", dict(TEXT=text("hi"), AUDIO_IN=np.full(16000, np.nan, np.float32))),
    "audio too long": ("AUDIO_IN", dict(TEXT=text(""), AUDIO_IN=np.zeros(16000 * 4, np.float32))),
    "audio of rank 2": ("AUDIO_IN", dict(TEXT=text("hi"), AUDIO_IN=np.zeros((2, 16000), np.float32))),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_arg_naming_the_field_and_server_keeps_serving(client, case):
    field, tensors = BAD_REQUESTS[case]
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "preprocess", **tensors)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value
    assert field in raised.value.message(), raised.value
    good = infer(client, "preprocess", TEXT=text("still fine?"))
    assert good.as_numpy("INPUT_IDS").size > 0


@pytest.fixture(scope="module")
def vocoder(triton_server):
    from omni_triton.models.weights import load_code2wav

    torch.set_num_threads(1)
    return load_code2wav(triton_server.checkpoint_dir).eval()


def random_codes(vocoder, frames: int, seed: int) -> np.ndarray:
    generator = np.random.default_rng(seed)
    return generator.integers(0, vocoder.config.codebook_size, (vocoder.num_quantizers, frames), dtype=np.int64)


def code2wav(client, codes: np.ndarray, left_context: int) -> np.ndarray:
    result = infer(client, "code2wav", CODES=codes[None], LEFT_CONTEXT=np.array([[left_context]], np.int32))
    return result.as_numpy("AUDIO")[0]


def test_code2wav_over_triton_equals_in_process_decode(client, vocoder):
    codes = random_codes(vocoder, 12, seed=0)
    with torch.inference_mode():
        expected = vocoder(torch.from_numpy(codes)[None])[0].numpy()
    audio = code2wav(client, codes, left_context=0)
    assert audio.shape == expected.shape == (12 * vocoder.samples_per_frame - vocoder.trim_samples,)
    np.testing.assert_allclose(audio, expected, atol=1e-5)

    # a later chunk: 5 frames of context, 7 new -> the samples its predecessor could not produce
    audio = code2wav(client, codes, left_context=5)
    start = 5 * vocoder.samples_per_frame - vocoder.trim_samples
    assert audio.shape == (7 * vocoder.samples_per_frame,)
    np.testing.assert_allclose(audio, expected[start:], atol=1e-5)


def test_code2wav_batches_concurrent_streams_of_different_lengths(triton_server, vocoder):
    chunks = [(random_codes(vocoder, frames, seed), context)
              for seed, (frames, context) in enumerate([(4, 0), (9, 3), (4, 1), (15, 10), (6, 0), (9, 3)])]

    def call(chunk):
        with triton_server.grpc_client() as own_client:
            return code2wav(own_client, *chunk)

    with ThreadPoolExecutor(len(chunks)) as pool:
        results = list(pool.map(call, chunks))
    for (codes, context), audio in zip(chunks, results):
        with torch.inference_mode():
            full = vocoder(torch.from_numpy(codes)[None])[0].numpy()
        start = context * vocoder.samples_per_frame - vocoder.trim_samples if context else 0
        np.testing.assert_allclose(audio, full[start:], atol=1e-5)


def test_code2wav_decodes_first_codes_past_the_codebook_as_transformers_does(client, vocoder):
    """A talker whose vocabulary is larger than the codebook emits such codes: quantizer q's code c reads row
    c + q * codebook_size of the shared embedding table, in transformers' Code2Wav and here."""
    codes = random_codes(vocoder, 6, seed=5)
    codes[0, 2] = vocoder.config.codebook_size + 3
    with torch.inference_mode():
        expected = vocoder(torch.from_numpy(codes)[None])[0].numpy()
    np.testing.assert_allclose(code2wav(client, codes, left_context=0), expected, atol=1e-5)


@pytest.mark.parametrize("left_context, bad_code, field", [
    (4, None, "LEFT_CONTEXT"),  # no new frame left
    (-1, None, "LEFT_CONTEXT"),
    (0, "past the table", "CODES"),  # the last quantizer's block ends the embedding table
    (0, "negative", "CODES"),
])
def test_code2wav_rejects_bad_chunks(client, vocoder, left_context, bad_code, field):
    codes = random_codes(vocoder, 4, seed=1)
    if bad_code == "past the table":
        codes[-1, 0] = vocoder.config.codebook_size
    elif bad_code == "negative":
        codes[0, 1] = -1
    with pytest.raises(InferenceServerException) as raised:
        code2wav(client, codes, left_context)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and field in raised.value.message()
    assert code2wav(client, random_codes(vocoder, 4, seed=2), 0).size > 0


def metric_value(metrics_url: str, name: str, labels: str = "") -> float | None:
    """A sample's value from the Prometheus text, e.g. labels='input="SPEAKER"'; None when absent."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", re.MULTILINE)
    for sample_labels, value in pattern.findall(text):
        if labels in sample_labels:
            return float(value)
    return None


def test_stages_export_prometheus_metrics(triton_server, client, vocoder):
    rejected = "omni_preprocess_rejected_requests_total"
    before = metric_value(triton_server.metrics_url, rejected, 'input="SPEAKER"') or 0.0
    with pytest.raises(InferenceServerException):
        infer(client, "preprocess", TEXT=text("hi"), SPEAKER=text("nobody"))
    assert metric_value(triton_server.metrics_url, rejected, 'input="SPEAKER"') == before + 1

    frames_before = metric_value(triton_server.metrics_url, "omni_code2wav_decoded_frames_total") or 0.0
    code2wav(client, random_codes(vocoder, 6, seed=4), left_context=2)
    assert metric_value(triton_server.metrics_url, "omni_code2wav_decoded_frames_total") == frames_before + 6
    assert metric_value(triton_server.metrics_url, "omni_code2wav_batch_chunks") >= 1


def test_client_streams_text_and_audio_through_the_omni_ensemble(triton_server):
    from omni_triton.client import OmniStreamClient

    if "omni" not in triton_server.models:
        pytest.skip("the omni ensemble's models are not all written yet")
    with OmniStreamClient(triton_server.grpc_url) as stream_client:
        with pytest.raises(InferenceServerException) as raised:
            stream_client.stream("hi", max_tokens=0)
        assert raised.value.code == "INVALID_ARG"  # named in the message (omni_triton.error_tags)
        assert "MAX_TOKENS must be in [1, " in raised.value.message()
        deltas = []
        result = stream_client.stream("Hello there", max_tokens=6, temperature=0.0, seed=0, max_audio_frames=12,
                                      on_text=deltas.append)
    assert result.text and "".join(deltas) == result.text
    assert result.audio.size > 0 and np.abs(result.audio).max() <= 1.0
    assert 0 < result.ttft_s <= result.total_s and 0 < result.ttfa_s <= result.total_s
    assert result.rtf == pytest.approx(result.total_s / result.audio_seconds)
