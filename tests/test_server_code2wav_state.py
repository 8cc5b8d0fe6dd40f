"""The code2wav stage keeping each audio stream's vocoder state (STREAM_ID chunks), over a real tritonserver.

Streams send new frames only; their concatenated audio must equal a one-pass decode, with chunks of many
streams batched in one call; bad stream requests are INVALID_ARG errors naming the input; STREAM_END frees the
state (the ``omni_code2wav_streams`` gauge goes back to 0). The whole pipeline runs stateful by default: its
audio vs transformers' one-pass decode and its cancel path are checked in test_server_pipeline.py.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from test_server_basic import infer, random_codes, text, vocoder  # noqa: F401 (fixture)

pytestmark = pytest.mark.server


def stream_chunk(client, stream_id: str, codes: np.ndarray | None, start: bool = False, end: bool = False):
    tensors = dict(STREAM_ID=text(stream_id)[None], STREAM_START=np.array([[start]]), STREAM_END=np.array([[end]]))
    if codes is not None:
        tensors["CODES"] = codes[None]
    return infer(client, "code2wav", **tensors).as_numpy("AUDIO")[0]


def open_streams(server) -> float:
    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return float(re.search(r'^omni_code2wav_streams\{stage="code2wav"\} (\S+)$', page, re.M).group(1))


def one_pass(vocoder, codes: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return vocoder(torch.from_numpy(codes)[None])[0].numpy()


def test_streams_batched_together_equal_one_pass(triton_server, vocoder):
    splits = [[4, 8, 24, 25], [1, 1, 1, 5, 9], [25, 25], [3, 7, 2]]

    def run(seed_split):
        seed, split = seed_split
        codes = random_codes(vocoder, sum(split), seed)
        stream_id, pieces, done = uuid.uuid4().hex, [], 0
        with triton_server.grpc_client() as own_client:
            for index, frames in enumerate(split):
                pieces.append(stream_chunk(own_client, stream_id, codes[:, done:done + frames], start=index == 0,
                                           end=index == len(split) - 1))
                done += frames
        return codes, pieces

    with ThreadPoolExecutor(len(splits)) as pool:
        results = list(pool.map(run, enumerate(splits)))
    for (codes, pieces), split in zip(results, splits):
        expected = one_pass(vocoder, codes)
        assert [len(p) for p in pieces] == [split[0] * vocoder.samples_per_frame - vocoder.trim_samples] + [
            n * vocoder.samples_per_frame for n in split[1:]]
        np.testing.assert_allclose(np.concatenate(pieces), expected, atol=1e-4)
    assert open_streams(triton_server) == 0  # every stream ended with STREAM_END


def test_chunks_of_any_length_share_a_call(triton_server):
    """CODES is a ragged input in the served config: Triton's batcher then groups chunks of different frame counts
    (the paced sizes vary per stream) instead of one frame count a call."""
    with triton_server.grpc_client() as client:
        config = client.get_model_config("code2wav", as_json=True)["config"]
    codes = next(tensor for tensor in config["input"] if tensor["name"] == "CODES")
    assert codes.get("allow_ragged_batch") is True and int(config["max_batch_size"]) > 1


def test_bad_stream_requests_are_errors_naming_the_input(triton_server, vocoder):
    codes = random_codes(vocoder, 6, seed=9)
    with triton_server.grpc_client() as client:
        with pytest.raises(InferenceServerException, match="STREAM_ID 'never-opened' is not a stream") as error:
            stream_chunk(client, "never-opened", codes)
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
        stream_chunk(client, "twice", codes[:, :2], start=True)
        with pytest.raises(InferenceServerException, match="STREAM_ID 'twice' is already open"):
            stream_chunk(client, "twice", codes[:, :2], start=True)
        with pytest.raises(InferenceServerException, match="CODES is missing"):
            stream_chunk(client, "twice", None)
        # the stream survived the bad requests: its next chunk still continues the one-pass waveform
        audio = stream_chunk(client, "twice", codes[:, 2:], end=True)
        np.testing.assert_allclose(audio, one_pass(vocoder, codes)[2 * vocoder.samples_per_frame
                                                                   - vocoder.trim_samples:], atol=1e-4)
        with pytest.raises(InferenceServerException, match="STREAM_ID 'twice' is not a stream"):
            stream_chunk(client, "twice", codes)  # ended: its state is gone
        with pytest.raises(InferenceServerException, match="CODES and LEFT_CONTEXT are needed"):
            infer(client, "code2wav", CODES=codes[None])  # neither a stream chunk nor a left-context one


def test_stream_end_without_codes_frees_the_state(triton_server, vocoder):
    """What a cancelled request's orchestrator sends: STREAM_END alone."""
    with triton_server.grpc_client() as client:
        stream_chunk(client, "cancelled", random_codes(vocoder, 4, seed=1), start=True)
        assert open_streams(triton_server) == 1
        assert stream_chunk(client, "cancelled", None, end=True).size == 0
        assert open_streams(triton_server) == 0
        stream_chunk(client, "cancelled", None, end=True)  # closing twice is harmless


def test_pipeline_streams_hold_state_while_speaking_and_free_it(triton_server):
    """The served default (--left-context-frames stateful): a request's audio stream holds one state in the
    code2wav stage while it speaks, none once it ended or was cancelled."""
    from omni_triton.client import OmniStreamClient

    held = []
    with OmniStreamClient(triton_server.grpc_url) as client:
        result = client.stream("Hello there", max_tokens=6, max_audio_frames=40, min_audio_frames=40,
                               ignore_eos=True, temperature=0.0, timeout_s=120,
                               on_audio=lambda chunk: held.append(open_streams(triton_server)))
    assert result.audio.size == 40 * 1920 - 555
    assert held and held[0] == 1, held  # the first chunk opened the stream's state
    cancelled = OmniStreamClient(triton_server.grpc_url)
    try:
        with pytest.raises(Exception):
            cancelled.stream("A long one", max_tokens=40, max_audio_frames=400, min_audio_frames=400, ignore_eos=True,
                             temperature=0.0, timeout_s=30, on_audio=lambda chunk: cancelled.cancel())
    finally:
        cancelled.client.close()
    deadline = time.monotonic() + 10
    while open_streams(triton_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_streams(triton_server) == 0
