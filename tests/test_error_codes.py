"""Every way a stream request can fail reaches the client with the Triton error code of its cause, and the
client's summary prints it: one test per code, against a real tritonserver admitting one request at a time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_LIMITS
from omni_triton.client import OmniStreamClient, StreamError, build_inputs, infer_inputs, main
from omni_triton.stages.orchestrator import REQUEST_INPUTS
from reliability_helpers import seconds_until_idle
from server_fixture import serving

pytestmark = pytest.mark.server

LONG_REQUEST = dict(max_tokens=60, max_audio_frames=400, min_audio_frames=400, ignore_eos=True, temperature=0.0)
SHORT_REQUEST = dict(max_tokens=4, max_audio_frames=4, temperature=0.0)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    with serving(tiny_checkpoint, tmp_path_factory.mktemp("error-codes"), max_inflight_requests=1,
                 admission_queue=0, **TEST_LIMITS) as handle:
        yield handle


def failure(server, text: str | None = "hi", *, inputs: list | None = None, timeout_s: float = 30,
            **scalars) -> StreamError:
    """The StreamError of one request (``inputs`` replaces the ones built from text and scalars)."""
    deadline_s = scalars.pop("deadline_s", None)
    with OmniStreamClient(server.grpc_url) as client:
        with pytest.raises(StreamError) as raised:
            client.stream_inputs(inputs or build_inputs(text, **scalars), timeout_s=timeout_s, deadline_s=deadline_s)
    assert raised.value.result.summary().startswith(f"FAILED {raised.value.code}: ")
    return raised.value


def assert_serves(server) -> None:
    """The next request is served. The server admits one request at a time and refuses the rest (busy); a
    request the test gave up on client-side may still be starting when the gauges first read idle, so a busy
    refusal is retried until the stages have really let go of it."""
    seconds_until_idle(server.metrics_url, timeout_s=5.0)
    deadline = time.monotonic() + 15.0
    with OmniStreamClient(server.grpc_url) as client:
        while True:
            try:
                assert client.stream("still there?", timeout_s=30, **SHORT_REQUEST).audio.size
                return
            except StreamError as error:
                if "busy" not in error.message() or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
            seconds_until_idle(server.metrics_url, timeout_s=5.0)


@pytest.mark.parametrize("inputs, field", [
    # no TEXT and no AUDIO_IN: the ensemble used to skip preprocess and end with an empty response, no error
    (lambda: [tensor for tensor in build_inputs("", max_tokens=3) if tensor.name() != "TEXT"], "TEXT"),
    (lambda: build_inputs("hi", seed=-2), "SEED"),
    (lambda: build_inputs("hi", talker_repetition_penalty=0.0), "TALKER_REPETITION_PENALTY"),
    # more frames than the talker's KV cache holds: used to fail inside the talker, and the client never heard
    (lambda: build_inputs("hi", max_audio_frames=TEST_LIMITS["kv_cache_tokens"]), "MAX_AUDIO_FRAMES"),
])
def test_bad_input_is_INVALID_ARG_naming_the_input(server, inputs, field):
    error = failure(server, inputs=inputs(), timeout_s=10)
    assert error.code == "INVALID_ARG" and field in error.message(), error


def test_request_past_admission_is_UNAVAILABLE(server):
    holder = OmniStreamClient(server.grpc_url)
    started = threading.Event()

    def hold_the_only_slot():
        try:
            holder.stream("a long one", timeout_s=60, on_text=lambda delta: started.set(), **LONG_REQUEST)
        except StreamError:
            pass  # cancelled below

    held = threading.Thread(target=hold_the_only_slot)
    held.start()
    try:
        assert started.wait(30), "the first request never started"
        error = failure(server)
        assert error.code == "UNAVAILABLE" and "max_inflight_requests" in error.message(), error
    finally:
        holder.cancel()
        held.join(30)
        holder.close()
    # the client's cancel returns at once; the server frees the slot when the session sees it (a race otherwise)
    seconds_until_idle(server.metrics_url, timeout_s=10.0)
    assert_serves(server)


def test_cancelled_request_is_CANCELLED(server):
    client = OmniStreamClient(server.grpc_url)
    try:
        with pytest.raises(StreamError) as raised:
            client.stream("a long one", timeout_s=30, on_audio=lambda chunk: client.cancel(), **LONG_REQUEST)
    finally:
        client.close()
    assert raised.value.code == "CANCELLED" and raised.value.result.audio.size, raised.value
    assert_serves(server)


def test_deadline_is_DEADLINE_EXCEEDED(server):
    error = failure(server, "a long one", deadline_s=0.5, **LONG_REQUEST)
    assert error.code == "DEADLINE_EXCEEDED" and "deadline_s 0.5 s exceeded" in error.message(), error
    assert 0.4 < error.result.total_s < 5
    seconds_until_idle(server.metrics_url, timeout_s=5.0)  # the server ends the request at its deadline too
    # the client's own wait for a response, too
    error = failure(server, "a long one", timeout_s=0.05, **LONG_REQUEST)
    assert error.code == "DEADLINE_EXCEEDED" and "no response from omni for 0.05 s" in error.message(), error
    assert_serves(server)


def test_server_fault_is_INTERNAL(server):
    """An id outside the vocabulary, sent to the orchestrator directly (nothing validates it on the way), fails
    that request alone inside the thinker: INTERNAL, and the thinker's batch keeps serving."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        prepared = client.infer("preprocess", build_inputs("hi", **SHORT_REQUEST))
    arrays = {name: prepared.as_numpy(name) for name in REQUEST_INPUTS}
    arrays["INPUT_IDS"] = np.array([1, 10**6, 2], np.int64)
    with OmniStreamClient(server.grpc_url, model="orchestrator") as client:
        with pytest.raises(StreamError) as raised:
            client.stream_inputs(infer_inputs(arrays), timeout_s=30)
    assert raised.value.code == "INTERNAL" and "INPUT_IDS must be in [0, " in raised.value.message(), raised.value
    assert_serves(server)


def test_command_line_client_prints_the_code_in_its_summary(server, capsys, tmp_path):
    assert main(["", "--url", server.grpc_url, "--out", str(tmp_path / "out.wav")]) == 1
    assert "FAILED INVALID_ARG: " in capsys.readouterr().err
