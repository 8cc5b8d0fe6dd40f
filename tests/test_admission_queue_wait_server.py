"""--admission-max-queue-wait on a real tritonserver (tiny checkpoint): with a forced capacity of 1 audio-second per
second one stream runs at a time, so a request behind it waits for it to end. On a cold server nothing is known of
that wait and a request queues, however short the bound; once streams ended the server expects a stream's length
(the prior from their lifetimes, before any drain rate of its queue is measured), so the next request that would
queue is refused at once with UNAVAILABLE naming admission_max_queue_wait (seconds, for a bound of a tenth of one),
while the others complete."""

from __future__ import annotations

import re

import pytest
from conftest import TEST_LIMITS
from test_admission_server import REQUEST, Listener, admission_counts, wait_for_gauge

pytestmark = pytest.mark.reliability

MAX_INFLIGHT = 4  # the default queue's free slots hold every request here: only the bound refuses
# short streams (~1 s on an idle 2-core CPU, ~3 s on a loaded one)
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


def test_once_streams_ended_a_request_that_would_wait_too_long_is_refused_at_once(server):
    before = admission_counts(server)
    first = Listener(server, "first: tell me a story", SHORT)
    wait_for_gauge(server, "omni_active_requests", 1)
    waiting = Listener(server, "waiting: tell me a story", SHORT)  # cold: nothing known, it waits, bound or not
    wait_for_gauge(server, "omni_admission_queue_length", 1)
    for listener in (first, waiting):
        assert listener.join().error is None, listener.error
    assert admission_counts(server)["refused"] == before["refused"]

    # warm: two lifetimes learned, one start out of the queue only (no drain rate measured): the prior decides
    playing = Listener(server, "playing: tell me a story", SHORT)
    wait_for_gauge(server, "omni_active_requests", 1)
    refused = Listener(server, "one too many", SHORT).join()
    assert refused.error is not None and refused.error.code == "UNAVAILABLE", refused.error
    message = refused.error.message()
    assert f"admission_max_queue_wait {MAX_QUEUE_WAIT_S:g} s" in message, message
    assert playing.running  # refused at once: not after waiting behind it
    # the wait for the stream playing to end: its predecessors' lifetimes, seconds (times of the orchestrator's clock)
    estimate = float(re.search(r"an estimated ([0-9.]+) s wait", message).group(1))
    assert 2 * MAX_QUEUE_WAIT_S < estimate < 60, message

    assert playing.join().error is None, playing.error
    assert playing.result.audio.size == first.result.audio.size  # served in full
    after = admission_counts(server)
    assert after["refused"] - before["refused"] == 1 and after["waited"] - before["waited"] == 1
