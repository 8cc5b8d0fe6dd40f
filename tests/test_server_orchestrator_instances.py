"""Two orchestrator instances on one pipeline in a real tritonserver (`serve --instances orchestrator=2`, on the
CPU): two processes take the requests in turn and serve what the in-process pipeline does, one client request id
sent to both at once stays two requests in the one thinker, a cancel ends its request whichever instance it
reaches, each instance reports its own series, and a drain is answered once both hold nothing."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omni_triton import trace
from omni_triton.client import OmniStreamClient, StreamError
from omni_triton.launch.drain import drain_orchestrator
from omni_triton.shared.drain import SHUTTING_DOWN
from omni_triton.shared.placement import Placement
from omni_triton.shared.stub_processes import find_stub_instances
from server_fixture import serving
from test_server_pipeline import (GREEDY, PROMPTS, check_concurrent_streams, inprocess, inprocess_run,  # noqa: F401
                                  stream, wait_idle)
from test_server_replicas import series

pytestmark = pytest.mark.server

INSTANCES = ("orchestrator_p0_0", "orchestrator_p0_1")
LONG = dict(max_tokens=4, max_audio_frames=3000, min_audio_frames=3000, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def two_orchestrators(tiny_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("orchestrators")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(trace.TRACE_DIR_ENV, str(run_dir / "trace"))  # the stubs inherit it: which instance took what
        with serving(tiny_checkpoint, run_dir, placement=Placement(instances={"orchestrator": 2}),
                     max_audio_frames_cap=4096) as handle:
            yield handle


def instance_tags(server, client_id: str | None = None, since: float = 0.0) -> set[str]:
    """The orchestrator instances (their request-id tags, ``<client id>#<index>.<n>``) that received a request of
    ``client_id`` (None: any) since ``since``."""
    events = trace.read_events(server.server.log_path.parent / "trace")
    tags = set()
    for request_id, named in events.items():
        match = re.fullmatch(r"(.*)#(\d+)\.\d+", request_id)
        if match and (client_id is None or match.group(1) == client_id) and named.get(
                "orchestrator.received", -1.0) >= since:
            tags.add(match.group(2))
    return tags


def test_two_processes_take_requests_in_turn_and_serve_what_the_inprocess_pipeline_does(two_orchestrators, inprocess):
    stubs = find_stub_instances(two_orchestrators.server.process.pid, ["orchestrator"])["orchestrator"]
    assert sorted(stubs) == list(INSTANCES) and len(set(stubs.values())) == 2
    check_concurrent_streams(two_orchestrators, inprocess)
    assert instance_tags(two_orchestrators) == {"0", "1"}  # both took some of the concurrent streams
    values = wait_idle(two_orchestrators, read=series)
    # each instance writes its own series (labelled by instance), none an unlabelled one that the other overwrites
    for metric in ("omni_active_requests", "omni_admission_queue_length", "omni_interstage_host_tensors_total"):
        labelled = sorted(re.search(r'model_instance="([^"]+)"', labels).group(1)
                          for (name, labels) in values if name == metric and 'stage="orchestrator"' in labels)
        assert labelled == list(INSTANCES), (metric, labelled)


def test_one_client_request_id_on_both_instances_stays_two_requests(two_orchestrators, inprocess):
    """The instances count their requests apart, so one client id sent twice at once would name one request in the
    thinker twice without the instance's tag; each of the two gets its own output."""
    prompts = PROMPTS[:2]
    alone = [inprocess_run(inprocess, prompt, **GREEDY) for prompt in prompts]
    for _ in range(6):  # Triton hands requests to free instances in turn: both usually take one at once
        since = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda prompt: stream(two_orchestrators, prompt, request_id="twin", **GREEDY),
                                   prompts))
        for prompt, result, (text, audio) in zip(prompts, served, alone):
            assert result.text == text, prompt
            np.testing.assert_allclose(result.audio, audio, atol=1e-4, err_msg=prompt)
        if instance_tags(two_orchestrators, "twin", since) == {"0", "1"}:
            break
    assert instance_tags(two_orchestrators, "twin", since) == {"0", "1"}, "6 pairs each went to one instance"
    wait_idle(two_orchestrators, read=series)


def test_a_cancel_ends_its_request_whichever_instance_it_reaches(two_orchestrators):
    """Two long streams at once (one per instance, usually); each cancelled at its first audio by a control request
    that Triton hands to either instance: both end CANCELLED and nothing is held after."""
    def cancelled_at_first_audio(text: str) -> StreamError:
        client = OmniStreamClient(two_orchestrators.grpc_url)
        try:
            with pytest.raises(StreamError, match="CANCELLED") as raised:
                client.stream(text, timeout_s=60, on_audio=lambda chunk: client.cancel(), **LONG)
            return raised.value
        finally:
            client.client.close()

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(cancelled_at_first_audio, ("one long story", "another long story")))
    assert len(errors) == 2
    wait_idle(two_orchestrators, timeout_s=15.0, read=series)


def test_a_drain_is_answered_once_both_instances_hold_nothing(two_orchestrators):
    """Last here (the server takes nothing after it): two long streams run, the drain's bound ends them with
    UNAVAILABLE naming the shutdown, the drain is answered, and a new request is refused the same way."""
    playing, ended = threading.Barrier(3), []

    def long_stream(text: str) -> None:
        started = []

        def on_audio(chunk):
            if not started:
                started.append(True)
                playing.wait(60)

        with OmniStreamClient(two_orchestrators.grpc_url) as client:
            try:
                client.stream(text, timeout_s=60, on_audio=on_audio, **LONG)
                ended.append(None)
            except StreamError as error:
                ended.append(error)

    threads = [threading.Thread(target=long_stream, args=(text,)) for text in ("one", "two")]
    for thread in threads:
        thread.start()
    playing.wait(60)  # both stream
    assert drain_orchestrator(two_orchestrators.grpc_url, drain_s=0.5) is None
    for thread in threads:
        thread.join(30)
    assert len(ended) == 2 and all(error is not None and error.code == "UNAVAILABLE" and SHUTTING_DOWN in
                                   error.message() for error in ended), [str(error) for error in ended]
    with pytest.raises(StreamError) as refused:
        stream(two_orchestrators, "after the drain", max_tokens=2, max_audio_frames=2)
    assert refused.value.code == "UNAVAILABLE" and SHUTTING_DOWN in refused.value.message()
