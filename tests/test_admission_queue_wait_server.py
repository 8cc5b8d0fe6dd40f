"""--admission-max-queue-wait on a real tritonserver (tiny checkpoint): with a forced capacity of 1 audio-second per
second one stream runs at a time, so requests behind it wait their turn and start one per stream's length. Before
two have started out of the queue the server knows nothing of its pace and lets them wait, however short the bound;
once they have, a request that would queue is refused at once with UNAVAILABLE naming admission_max_queue_wait
(it expects to wait about a stream's length, seconds, for a bound of a tenth of one), while the others complete."""

from __future__ import annotations

import pytest
from conftest import TEST_LIMITS
from test_admission_server import REQUEST, Listener, admission_counts, orchestrator_gauge, wait_for_gauge

pytestmark = pytest.mark.reliability

MAX_INFLIGHT = 4  # one streaming and three waiting: the default queue's free slots hold them all
# four streams one after the other: short ones (~1 s on an idle 2-core CPU, ~3 s on a loaded one)
SHORT = {**REQUEST, "max_audio_frames": 60, "min_audio_frames": 60}
# far below a stream's length on any CPU (its prefills alone take longer), and the dispatcher polls every 50 ms
MAX_QUEUE_WAIT_S = 0.1


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path_factory.mktemp("admission-queue-wait"),
                 max_inflight_requests=MAX_INFLIGHT, admission_capacity="1",
                 admission_max_queue_wait=MAX_QUEUE_WAIT_S, **TEST_LIMITS) as handle:
        yield handle


def test_once_the_queue_pace_is_learned_a_request_that_would_wait_too_long_is_refused_at_once(server):
    before = admission_counts(server)
    first = Listener(server, "first: tell me a story", SHORT)
    wait_for_gauge(server, "omni_active_requests", 1)
    waiting = []
    for position in range(MAX_INFLIGHT - 1):  # nothing learned yet: they wait, bound or not
        waiting.append(Listener(server, f"waiting {position}: tell me a story", SHORT))
        wait_for_gauge(server, "omni_admission_queue_length", position + 1)
    assert admission_counts(server)["refused"] == before["refused"]

    # two started out of the queue, one a stream's length after the other: the pace is learned; the last one
    # still waits (or, on a slow poll, has just started), so a new request cannot start
    wait_for_gauge(server, "omni_admission_waited_requests", before["waited"] + 2, timeout_s=60.0)
    refused = Listener(server, "one too many", SHORT).join()
    assert refused.error is not None and refused.error.code == "UNAVAILABLE", refused.error
    message = refused.error.message()
    assert "an estimated" in message and f"admission_max_queue_wait {MAX_QUEUE_WAIT_S:g} s" in message, message
    assert waiting[-1].running  # refused at once: not after waiting behind the last one

    for listener in (first, *waiting):
        assert listener.join().error is None, listener.error
        assert listener.result.audio.size == first.result.audio.size  # served in full
    after = admission_counts(server)
    assert after["refused"] - before["refused"] == 1 and after["waited"] - before["waited"] == MAX_INFLIGHT - 1
    # the gauge the bound reads: a stream's length per start, far past the bound
    assert orchestrator_gauge(server, "omni_admission_expected_wait_seconds") > 2 * MAX_QUEUE_WAIT_S
