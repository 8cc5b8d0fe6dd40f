"""The admission queue's default bound and --admission-max-wait on a real tritonserver (tiny checkpoint): with a
forced capacity of 1 audio-second per second one stream runs at a time, so with --max-inflight 3 and the default
queue two requests may wait and a third is refused at once naming max_inflight_requests (by preprocess, from the
orchestrator's admission board, before its work); the two that waited are
refused once they waited --admission-max-wait, while the stream ahead of them still plays (they never start late);
and the server serves the next request as soon as it is free."""

from __future__ import annotations

import threading

import pytest
from conftest import TEST_LIMITS
from reliability_helpers import seconds_until_idle
from test_admission_server import Listener, admission_counts, orchestrator_gauge, wait_for_gauge

from omni_triton.client import OmniStreamClient, StreamError

pytestmark = pytest.mark.reliability

MAX_INFLIGHT = 3
# long enough for the waiting ones to queue before it (a margin for a loaded CPU), short enough for a test
MAX_WAIT_S = 6.0
# far longer than MAX_WAIT_S on any CPU; cancelled once the test has seen what it needs (a KV budget to hold it)
LONG = dict(max_tokens=12, max_audio_frames=4000, min_audio_frames=4000, ignore_eos=True, temperature=0.0)
LIMITS = {**TEST_LIMITS, "kv_cache_tokens": 4608}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path_factory.mktemp("admission-bound"), max_inflight_requests=MAX_INFLIGHT,
                 admission_capacity="1", admission_max_wait=MAX_WAIT_S, **LIMITS) as handle:
        yield handle


class LongStream:
    """A stream that plays until cancelled."""

    def __init__(self, server):
        self.error = None
        self._client = OmniStreamClient(server.grpc_url)
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._client.stream("a very long story", timeout_s=300, **LONG)
        except StreamError as error:
            self.error = error

    def cancel(self) -> None:
        self._client.cancel()
        self._thread.join(60)
        assert not self._thread.is_alive()
        self._client.close()


def test_the_default_queue_holds_the_free_slots_and_a_request_waits_no_longer_than_max_wait(server):
    before = admission_counts(server)
    long = LongStream(server)
    wait_for_gauge(server, "omni_active_requests", 1)
    assert long.error is None, long.error
    waiting = [Listener(server, f"waiting {position}: tell me a story") for position in range(MAX_INFLIGHT - 1)]
    wait_for_gauge(server, "omni_admission_queue_length", MAX_INFLIGHT - 1)

    refused = Listener(server, "one too many").join()  # 1 streaming + 2 waiting = --max-inflight
    assert refused.error is not None and refused.error.code == "UNAVAILABLE", refused.error
    message = refused.error.message()
    assert "max_inflight_requests" in message and "1 streaming and 2 waiting" in message, message

    for listener in waiting:  # refused once they waited MAX_WAIT_S, not started when the long stream ends
        assert listener.join().error is not None and listener.error.code == "UNAVAILABLE", listener.result
        assert "admission_max_wait 6 s" in listener.error.message() and not listener.audio_times
    wait_for_gauge(server, "omni_admission_queue_length", 0)  # the gauges lag the responses a little
    assert orchestrator_gauge(server, "omni_active_requests") == 1  # the long stream still plays
    after = admission_counts(server)
    assert after["refused"] - before["refused"] == MAX_INFLIGHT
    assert after["early"] - before["early"] == 1  # the one too many: by preprocess, before its work
    assert after["waited"] == before["waited"]

    long.cancel()
    assert long.error is not None and long.error.code == "CANCELLED", long.error
    seconds_until_idle(server.metrics_url, timeout_s=10.0)
    served = Listener(server, "after the burst").join()  # nothing waits: served at once, in full
    assert served.error is None and served.result.audio.size
    assert admission_counts(server)["waited"] == before["waited"]
