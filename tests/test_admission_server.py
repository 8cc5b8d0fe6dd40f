"""Admission by real-time capacity on a real tritonserver (tiny checkpoint): a forced capacity of 1 audio-second
per second admits one stream at a time whatever the CPU's speed, so a burst beyond it queues, is served in
arrival order, and past the queue limit is refused with UNAVAILABLE naming the limit: by preprocess, at once, when
the requests on their way to the orchestrator already fill its room."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import TEST_LIMITS
from reliability_helpers import read_gauges, seconds_until_idle

from omni_triton.client import OmniStreamClient, StreamError
from omni_triton.shared.stub_processes import find_stubs

pytestmark = pytest.mark.reliability

QUEUE = 2
# ~2 s of generation on the tiny model: the first stream is still playing while the others arrive
REQUEST = dict(max_tokens=12, max_audio_frames=150, min_audio_frames=150, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path_factory.mktemp("admission"), max_inflight_requests=4,
                 admission_queue=QUEUE, admission_capacity="1", **TEST_LIMITS) as handle:
        yield handle


def orchestrator_gauge(server, name: str) -> float:
    return read_gauges(server.metrics_url).get((name, "orchestrator"), 0.0)


def admission_counts(server) -> dict[str, float]:
    """Requests that waited, and those refused by admission: by the orchestrator, or by preprocess before its work
    from the orchestrator's admission board ("early", counted in "refused" too)."""
    values = read_gauges(server.metrics_url)
    early = values.get(("omni_preprocess_refused_busy_requests_total", "preprocess"), 0.0)
    return {"waited": values.get(("omni_admission_waited_requests", "orchestrator"), 0.0), "early": early,
            "refused": values.get(("omni_admission_refused_requests", "orchestrator"), 0.0) + early}


def wait_for_gauge(server, name: str, value: float, timeout_s: float = 30.0) -> None:
    start = time.monotonic()
    while orchestrator_gauge(server, name) != value:
        assert time.monotonic() - start < timeout_s, f"{name} never reached {value}"
        time.sleep(0.02)


class Listener:
    """One request on a thread of its own, with the arrival time of every audio chunk."""

    def __init__(self, server, text: str, request: dict = REQUEST):
        self.audio_times: list[float] = []
        self.result, self.error = None, None
        self._client = OmniStreamClient(server.grpc_url)
        self._thread = threading.Thread(target=self._run, args=(text, request))
        self._thread.start()

    def _run(self, text: str, request: dict) -> None:
        try:
            self.result = self._client.stream(text, timeout_s=120, on_audio=lambda _: self.audio_times.append(
                time.monotonic()), **request)
        except StreamError as error:
            self.error = error
        finally:
            self._client.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> "Listener":
        self._thread.join(180)
        assert not self._thread.is_alive()
        return self


def test_a_burst_beyond_capacity_waits_in_order_and_past_the_queue_is_refused(server):
    before = admission_counts(server)
    first = Listener(server, "first: tell me a story")
    wait_for_gauge(server, "omni_active_requests", 1)
    waiting = []
    for position in range(QUEUE):  # one at a time, so that their arrival order is known
        waiting.append(Listener(server, f"waiting {position}: tell me a story"))
        wait_for_gauge(server, "omni_admission_queue_length", position + 1)
    assert orchestrator_gauge(server, "omni_active_requests") == 1  # capacity 1: they wait, not run
    refused = Listener(server, "one too many").join()

    assert refused.error is not None and refused.error.code == "UNAVAILABLE", refused.error
    assert "admission_queue" in refused.error.message() and "busy" in refused.error.message()
    assert first.join().error is None and first.result.audio.size
    for listener in waiting:
        assert listener.join().error is None, listener.error
        assert listener.result.audio.size == first.result.audio.size  # served in full
    # in arrival order, one at a time: each starts once the one before has sent all its audio
    order = [first, *waiting]
    for earlier, later in zip(order, order[1:]):
        assert later.audio_times[0] > earlier.audio_times[-1]
    after = admission_counts(server)
    assert after["waited"] - before["waited"] == QUEUE and after["refused"] - before["refused"] == 1
    assert orchestrator_gauge(server, "omni_admission_wait_seconds") > 0
    assert orchestrator_gauge(server, "omni_realtime_capacity_audio_s_per_s") == 1.0
    seconds_until_idle(server.metrics_url, timeout_s=5.0)
    assert orchestrator_gauge(server, "omni_admission_queue_length") == 0


def test_a_request_cancelled_while_waiting_leaves_the_queue(server):
    first = Listener(server, "first: tell me a story")
    wait_for_gauge(server, "omni_active_requests", 1)
    client = OmniStreamClient(server.grpc_url)
    outcome = {}

    def wait_then_cancel():
        try:
            client.stream("cancelled while waiting", timeout_s=60, **REQUEST)
        except StreamError as error:
            outcome["error"] = error

    thread = threading.Thread(target=wait_then_cancel)
    thread.start()
    wait_for_gauge(server, "omni_admission_queue_length", 1)
    client.cancel()
    thread.join(60)
    client.close()
    assert "error" in outcome and outcome["error"].code in ("CANCELLED", "UNAVAILABLE"), outcome
    wait_for_gauge(server, "omni_admission_queue_length", 0)
    assert first.join().error is None
    seconds_until_idle(server.metrics_url, timeout_s=5.0)


def test_a_request_waiting_when_a_stage_dies_is_refused_naming_it(tiny_checkpoint, tmp_path):
    """A request waiting for admission when code2wav's stub is killed: it must end UNAVAILABLE naming the stage
    (refused while the stage is down, as a new request is), never start on the dead stage and fail INTERNAL
    "code2wav stage is down" (what it did: a request admitted before the death was seen and started after it, the
    likely source of the INTERNALs of issue 48's killed code2wav and orchestrator on the H200). A server of its own
    (model control none: the stage stays down, whatever the timing)."""
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path, max_inflight_requests=4, admission_queue=QUEUE,
                 admission_capacity="1", **TEST_LIMITS) as server:
        first = Listener(server, "first: tell me a story")
        while not first.audio_times:  # code2wav holds its stream
            assert first._thread.is_alive(), first.error
            time.sleep(0.01)
        waiting = Listener(server, "waiting: tell me a story")
        wait_for_gauge(server, "omni_admission_queue_length", 1)
        os.kill(find_stubs(server.server.process.pid, ["code2wav"])["code2wav"], signal.SIGKILL)
        for listener in (first.join(), waiting.join()):
            assert listener.error is not None and listener.error.code == "UNAVAILABLE", listener.error
            assert "code2wav stage" in str(listener.error), listener.error
        assert "code2wav stage is down" in str(waiting.error) or "code2wav stage failed" in str(waiting.error)
        wait_for_gauge(server, "omni_admission_queue_length", 0)


def test_a_burst_is_refused_by_preprocess_while_the_orchestrator_lags_behind_it(server):
    """Issue 48's burst: on an H200 at 4x goodput the orchestrator's thread lagged behind the arrivals, requests went
    on on its stale outlook and were refused there up to 320 ms after they were sent, later than the admitted
    streams' first audio. Preprocess counts those it let through that the orchestrator has not received against the
    room it published; here the orchestrator's stub is stopped (SIGSTOP) while a burst arrives, so its outlook stays
    stale: the requests past its room must still be refused, by preprocess, and only QUEUE go on. (A stub stopped for
    more than a second fails what reaches it with "Stub process ... is not healthy": only those let through may
    meet that, and it is resumed as soon as the refusals are in.)"""
    burst_size = QUEUE + 4
    first = Listener(server, "first: tell me a story")
    wait_for_gauge(server, "omni_active_requests", 1)  # capacity 1: room for QUEUE waiting
    orchestrator = find_stubs(server.server.process.pid, ["orchestrator"])["orchestrator"]
    before = admission_counts(server)
    os.kill(orchestrator, signal.SIGSTOP)
    try:
        burst = [Listener(server, f"burst {index}: tell me a story") for index in range(burst_size)]
        deadline = time.monotonic() + 60  # for preprocess on a loaded CPU; the orchestrator answers none meanwhile
        while sum(not listener.running for listener in burst) < burst_size - QUEUE and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = [listener for listener in burst if not listener.running]
    finally:
        os.kill(orchestrator, signal.SIGCONT)
    assert len(refused) == burst_size - QUEUE, f"{len(refused)} of {burst_size} answered while it was stopped"
    for listener in refused:
        assert listener.error is not None and listener.error.code == "UNAVAILABLE", listener.error
        assert "admission_queue" in listener.error.message()
    first.join()
    for listener in burst:  # those let through wait their turn (or met the stopped stub's health check)
        assert listener.join().error is None or listener in refused or "not healthy" in str(listener.error)
    after = admission_counts(server)
    # every refusal decided by preprocess before its work; none late, by the orchestrator
    assert after["early"] - before["early"] == after["refused"] - before["refused"] == burst_size - QUEUE
    seconds_until_idle(server.metrics_url, timeout_s=10.0)


def test_direct_calls_to_preprocess_take_no_room_from_the_ensemble(server):
    """What reverted this work once: a client calling preprocess itself (a test, perf_analyzer, a tokenizing tool)
    never reaches an orchestrator, yet was counted as on its way to one, so after a few such calls preprocess
    refused every omni request with UNAVAILABLE for seconds. Here more direct calls than the orchestrator's room
    (1 starting, QUEUE waiting), at once, then omni requests: each must be served, none refused."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    before = admission_counts(server)
    text = grpcclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"only tokenize this"], dtype=np.object_))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for _ in range(1 + QUEUE + 2):  # every output (the default), and only the outputs named
            everything = client.infer("preprocess", [text])
            assert everything.as_numpy("INPUT_IDS").size and everything.as_numpy("LET_THROUGH_NS")[0] == 0
            assert client.infer("preprocess", [text], outputs=[grpcclient.InferRequestedOutput("INPUT_IDS")])
    for index in range(2):  # one after the other: each alone on the server, with room for it
        listener = Listener(server, f"after direct calls {index}").join()
        assert listener.error is None, listener.error
    after = admission_counts(server)
    assert after["early"] == before["early"] and after["refused"] == before["refused"]
