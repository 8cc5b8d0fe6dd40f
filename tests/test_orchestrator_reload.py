"""`serve --allow-stage-reload` brings a killed orchestrator back alone: the launcher's supervise loop reloads it
through the repository API (Triton reloads the ``omni`` ensemble on top of it), the tritonserver process and the
stage stubs are kept, and the stages drop what the dead orchestrator's requests held in them (``stages.callers``:
without that, the first response a stage sends to the dead stub blocks that stage for good).

With several orchestrator instances (``--pipelines 2``: one per pipeline; ``--instances orchestrator=2``: two on one
pipeline) Triton reloads the whole orchestrator model: both instances get fresh stubs, and the requests in flight on
the live instance run to their end on its old stub. The dead instance's requests end at once with UNAVAILABLE naming
the orchestrator stage and the instance on the built Python backend with ``python_backend-dead-stub-requests.patch``;
on any other they get no answer (they end at the client's own timeout). Either way the old model version stays
loaded, its stubs idle (the patch keeps the lost requests' response factories: unloading an orchestrator version that
served streams crashes tritonserver, see the patch)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reliability_helpers import HELD_GAUGES, raw_stream
from test_reliability import FAULT_REQUEST, MAX_INFLIGHT, _until_served, start_fault_server
from test_server_replicas import series

from omni_triton.client import build_inputs
from omni_triton.error_tags import code_of
from omni_triton.launch.python_backend import load_built_backend
from omni_triton.launch.serve import STAGE_RELOADED
from omni_triton.launch.tritonserver import instance_model
from omni_triton.shared.placement import Placement, model_stage
from omni_triton.shared.stub_processes import find_stub_instances, find_stubs

pytestmark = pytest.mark.reliability

# long enough that every stage still holds each stream at the kill, short enough that a live instance's streams
# end soon after it
RELOAD_REQUEST = dict(FAULT_REQUEST, max_tokens=300)
# a stream silent this long has no answer coming (the dead instance's); the live ones answer every few frames
CLIENT_TIMEOUT_S = 15


def per_pipeline(server, metric: str, stage: str) -> dict[int, float]:
    """pipeline -> value of ``stage``'s ``metric``, summed over its instances (a server of one pipeline: its series
    without a pipeline label, as pipeline 0)."""
    found: dict[int, float] = {}
    for (name, labels), value in series(server).items():
        if name == metric and f'stage="{stage}"' in labels:
            pipeline = re.search(r'pipeline="(\d+)"', labels)
            key = int(pipeline.group(1)) if pipeline else 0
            found[key] = found.get(key, 0.0) + value
    return found


def per_orchestrator(server) -> dict[str, float]:
    """orchestrator instance name -> the streams it holds (its series' model_instance label, else its pipeline's
    one instance)."""
    found = {}
    for (name, labels), value in series(server).items():
        if name == "omni_active_requests" and 'stage="orchestrator"' in labels:
            instance = re.search(r'model_instance="([^"]+)"', labels)
            pipeline = re.search(r'pipeline="(\d+)"', labels)
            found[instance.group(1) if instance else f"orchestrator_p{pipeline.group(1)}_0" if pipeline
                  else "orchestrator_0_0"] = value
    return found


def holding_every_stream(server) -> dict[str, float] | None:
    """orchestrator instance -> streams it holds, once every stage holds all MAX_INFLIGHT streams (thinker and
    talker requests, code2wav stream states); else None."""
    held = per_orchestrator(server)
    stages = (("omni_active_requests", "thinker"), ("omni_active_requests", "talker"),
              ("omni_code2wav_streams", "code2wav"))
    if sum(held.values()) == MAX_INFLIGHT and all(sum(per_pipeline(server, metric, stage).values()) == MAX_INFLIGHT
                                                  for metric, stage in stages):
        return held
    return None


def ends_dead_stub_requests(install) -> bool:
    """Whether the server's Python backend ends a dead stub's requests (``BuiltBackend.ends_dead_stub_requests``)."""
    built, _ = load_built_backend(install.backend_dir) if install.python_backend == "built" else (None, "")
    return built is not None and built.ends_dead_stub_requests


def until(condition, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.05)
    return value


def test_instance_names_map_to_their_model():
    assert instance_model("orchestrator_0_0") == "orchestrator"
    assert instance_model("orchestrator_0_1") == "orchestrator"  # several instances of one group
    assert instance_model("orchestrator_p1_0") == "orchestrator"  # a pipeline's group (placement.instance_group)
    assert instance_model("thinker_p1_0_0") == "thinker_p1"
    assert instance_model("code2wav_0_1") == "code2wav"


@pytest.mark.parametrize("placement", [Placement(), Placement(pipelines=2), Placement(instances={"orchestrator": 2})],
                         ids=["one", "pipelines=2", "orchestrator=2"])
def test_killed_orchestrator_is_reloaded_alone_and_the_stages_drop_its_requests(tiny_checkpoint, tmp_path, placement):
    server = start_fault_server(tiny_checkpoint, tmp_path, placement)
    triton = server.server
    stopping = threading.Event()
    log: list[str] = []
    watcher = threading.Thread(target=triton.supervise, daemon=True, kwargs=dict(
        ready_timeout_s=120, max_restarts=0, log=log.append, reloaded_by_orchestrator=STAGE_RELOADED,
        stopped=stopping.is_set))
    try:
        watcher.start()
        server_pid = triton.process.pid
        orchestrators = find_stub_instances(server_pid, ["orchestrator"])["orchestrator"]
        stages = find_stubs(server_pid, [m for m in triton.repository_models() if m not in ("omni", "orchestrator")])

        ended_at: dict[int, float] = {}

        def in_flight(index: int):
            try:
                error = raw_stream(server.grpc_url, build_inputs(f"Orchestrator fault {index}: a long story.",
                                                                 **RELOAD_REQUEST), timeout_s=CLIENT_TIMEOUT_S).error
            except TimeoutError as timeout:  # the dead instance's requests: see the assertion below
                error = f"no response: {timeout}"
            if error is not None:
                ended_at[index] = time.monotonic()
            return error

        with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
            futures = [pool.submit(in_flight, index) for index in range(MAX_INFLIGHT)]
            # with several each orchestrator instance holds some (Triton hands new requests out in turn)
            held = until(lambda: holding_every_stream(server), "every stage holding every stream", 60)
            assert sorted(name for name, count in held.items() if count) == sorted(orchestrators), held
            victim = min(orchestrators)
            os.kill(orchestrators[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            refusals, served_after = _until_served(server, time.monotonic(), timeout_s=90)
            outcomes = [future.result() for future in futures]  # each ends: answered, or at the client's timeout
        until(lambda: any("orchestrator reloaded alone" in line for line in log), "the reload", 120)
        # a stage whose send to the dead stub was under way at the kill exits (callers) and is reloaded
        until(lambda: len(find_stubs(server_pid, list(stages))) == len(stages), "every stage serving", 120)
        # every stage lets go of the dead orchestrator's requests: no KV block, request or stream held
        until(lambda: not {key: value for key, value in series(server).items()
                           if key[0] in (*HELD_GAUGES, "omni_code2wav_streams") and value}, "every stage idle", 20)
        reloaded = {model for model, pid in find_stubs(server_pid, list(stages)).items() if pid != stages[model]}
        print(f"\norchestrator {victim} killed under {MAX_INFLIGHT} streams ({held}): served again {served_after:.1f} "
              f"s after the kill ({len(refusals)} refused meanwhile: {refusals[:1]}); in flight: {outcomes}; "
              f"launcher: {log}; stages reloaded (a send under way at the kill): {sorted(reloaded)}; streams "
              f"failed {sorted(round(at - killed_at, 2) for at in ended_at.values())} s after the kill")

        assert triton.process.pid == server_pid and triton.process.poll() is None, "the server is not restarted"
        after = find_stub_instances(server_pid, ["orchestrator"])["orchestrator"]
        assert sorted(after) == sorted(orchestrators) and not set(after.values()) & set(orchestrators.values()), \
            "every orchestrator instance has a fresh stub"
        server_log = triton.log_path.read_text(errors="replace")
        assert all(re.search(rf"{model_stage(model)[0]} stage: a response to a caller that died .* exiting", server_log)
                   for model in reloaded), f"{reloaded} died of something else than a send stuck on the dead stub"
        # The live instances' requests run to their end on their old stubs, unless a stage they share with the dead
        # one exited (then UNAVAILABLE naming it, as for any dead stage).
        if ends_dead_stub_requests(triton.install):
            # the backend ends each request the dead stub held at once (the client's timeout is only a hang guard),
            # with UNAVAILABLE naming the stage and the instance: the code as the pipeline's tag, which the
            # ensemble keeps (its own code it turns into UNKNOWN)
            lost = [outcome for outcome in outcomes
                    if outcome is not None and f"stub process of model instance '{victim}' exited" in outcome]
            assert len(lost) == held[victim], outcomes
            assert all(code_of(outcome) == "UNAVAILABLE" and "orchestrator stage failed" in outcome
                       for outcome in lost), lost
            # what Triton handed the dead instance until the reload was refused the same way, not with upstream's
            # "Stub process '<instance>' is not healthy." (INTERNAL, no stage named)
            to_dead = [refusal for refusal in refusals if f"'{victim}'" in refusal]
            assert all(code_of(refusal) == "UNAVAILABLE" and "orchestrator stage" in refusal
                       for refusal in to_dead), to_dead
        else:
            # Triton 2.51's Python backend never answers a request whose stub died (the stub held its response
            # factory): the client's own timeout ends it, and the old model version never unloads
            lost = [outcome for outcome in outcomes if outcome is not None and outcome.startswith("no response")]
            assert len(lost) == held[victim], outcomes
        assert all(outcome is None or outcome in lost or any(f"{model} stage failed" in outcome
                                                              for model in reloaded) for outcome in outcomes)
        assert "Signal (" not in triton.log_path.read_text(errors="replace"), triton.log_tail()
    finally:
        stopping.set()
        watcher.join(10)
        server.stop_after_tests()  # killed: a graceful stop waits out the exit timeout (the dead stub's requests)
