"""A burst at a server with one free slot, on a real tritonserver (tiny checkpoint): preprocess lets through only
as many requests as the orchestrator has room for, counting those it let through that the orchestrator has not
received yet, so every other request of the burst is refused by preprocess at once, without waiting for the
orchestrator's thread (issue 48's burst: on an H200 at 4x goodput the orchestrator's thread lagged behind the
arrivals, requests went on on its stale outlook and were refused there up to 320 ms after they were sent, later
than the admitted streams' first audio). Here the orchestrator's stub is stopped (SIGSTOP) during the burst, so its
outlook is stale while preprocess answers: the refusals must come back, and only one request may go on. (Stopped
for more than a second, its requests would fail "Stub process ... is not healthy": with the change, only the one let
through reaches it, and it is resumed as soon as the refusals are in.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import TEST_LIMITS
from reliability_helpers import seconds_until_idle
from test_admission_bound_server import LONG, LongStream
from test_admission_server import admission_counts, orchestrator_gauge, wait_for_gauge

from omni_triton.client import OmniStreamClient, StreamError
from omni_triton.shared.stub_processes import find_stubs

pytestmark = pytest.mark.reliability

MAX_INFLIGHT = 2
BURST = 6
REFUSALS_WITHIN_S = 60.0  # for preprocess to answer them on a loaded CPU; they never come while it waits instead


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from server_fixture import serving

    with serving(tiny_checkpoint, tmp_path_factory.mktemp("refusal-in-transit"), max_inflight_requests=MAX_INFLIGHT,
                 admission_queue=0, admission_capacity="off",
                 **{**TEST_LIMITS, "kv_cache_tokens": 4608 * MAX_INFLIGHT}) as handle:
        yield handle


class BurstRequest:
    """A long request on a stream of its own, on a thread of its own."""

    def __init__(self, server, index: int):
        self.error: StreamError | None = None
        self.client = OmniStreamClient(server.grpc_url)
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(index,), daemon=True).start()

    def _run(self, index: int) -> None:
        try:
            self.client.stream(f"burst request {index}", timeout_s=300, **LONG)
        except StreamError as error:
            self.error = error
        self.done.set()


def test_a_burst_past_the_free_slots_is_refused_by_preprocess_while_the_orchestrator_lags(server):
    holder = LongStream(server)
    wait_for_gauge(server, "omni_active_requests", 1)  # one slot of MAX_INFLIGHT left
    orchestrator = find_stubs(server.server.process.pid, ["orchestrator"])["orchestrator"]
    before = admission_counts(server)
    os.kill(orchestrator, signal.SIGSTOP)
    try:
        burst = [BurstRequest(server, index) for index in range(BURST)]
        deadline = time.monotonic() + REFUSALS_WITHIN_S
        while sum(request.done.is_set() for request in burst) < BURST - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = [request for request in burst if request.done.is_set()]
        # answered while the orchestrator could not have: refused by preprocess, one left to go on
        assert len(refused) == BURST - 1, f"{len(refused)} of {BURST} answered while the orchestrator was stopped"
        errors = [request.error for request in refused]
        assert all(error is not None and error.code == "UNAVAILABLE" and "max_inflight_requests" in error.message()
                   for error in errors), errors
        assert admission_counts(server)["early"] - before["early"] == BURST - 1
    finally:
        os.kill(orchestrator, signal.SIGCONT)
    [let_through] = [request for request in burst if request not in refused]
    deadline = time.monotonic() + REFUSALS_WITHIN_S
    while not let_through.done.is_set() and orchestrator_gauge(server, "omni_active_requests") < MAX_INFLIGHT:
        assert time.monotonic() < deadline, "the request let through neither started nor ended"
        time.sleep(0.02)
    after = admission_counts(server)
    assert after["refused"] - before["refused"] == BURST - 1  # none refused late, by the orchestrator
    for request in burst:
        if not request.done.is_set():
            request.client.cancel()
            assert request.done.wait(60)
        request.client.close()
    holder.cancel()
    seconds_until_idle(server.metrics_url, timeout_s=10.0)
