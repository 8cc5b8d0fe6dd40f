"""Two whole pipelines in one real tritonserver (`serve --pipelines 2`, on the CPU): each stage is rendered once per
pipeline (thinker_p0, thinker_p1, ...) and the orchestrator runs one instance (one process) per pipeline; concurrent
requests spread over both and get the in-process pipeline's output, one seed gives one audio on either pipeline, the
metrics say what each pipeline holds, a cancel frees the pipeline that holds the request while the other goes on,
whichever orchestrator instance the cancel reaches, and a dead stage closes only its own pipeline."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from omni_triton import trace
from omni_triton.client import OmniStreamClient, StreamError, send_cancel
from omni_triton.shared.cancel_registry import registry_dir
from omni_triton.shared.placement import Placement
from omni_triton.shared.stub_processes import find_stub_instances
from server_fixture import serving
from test_server_pipeline import PROMPTS, check_concurrent_streams, inprocess, stream  # noqa: F401 (fixture)
from test_server_replicas import series

pytestmark = pytest.mark.server

STAGES = ("thinker", "talker", "code2wav")
NOBODY = "held-by-nobody"  # request ids of cancels that cancel nothing


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipelines")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(trace.TRACE_DIR_ENV, str(run_dir / "trace"))  # the stubs inherit it: which instance got a cancel
        with serving(tiny_checkpoint, run_dir, placement=Placement(pipelines=2), max_audio_frames_cap=4096) as handle:
            server_pid = handle.server.process.pid
            assert registry_dir(server_pid).is_dir()  # the orchestrator instances' cancel registry
            yield handle
    assert not registry_dir(server_pid).exists()  # gone with the server


def served_pipeline(before: dict, after: dict) -> int:
    """The pipeline whose thinker served the one request made between two ``inference_counts``."""
    (pipeline,) = [p for p in (0, 1) if after[f"thinker_p{p}"] > before[f"thinker_p{p}"]]
    return pipeline


def per_pipeline(values: dict, metric: str, stage: str | None = None) -> dict[int, float]:
    """pipeline -> value of ``metric`` (of ``stage``; None: a stage's own metric, with no stage label), from the
    series with a pipeline label."""
    found = {}
    for (name, labels), value in values.items():
        pipeline = re.search(r'pipeline="(\d+)"', labels)
        if name == metric and (stage is None or f'stage="{stage}"' in labels) and pipeline:
            found[int(pipeline.group(1))] = value
    return found


def inference_counts(server) -> dict[str, int]:
    """Triton's own count of requests each pipeline model executed."""
    with server.grpc_client() as client:
        return {f"{stage}_p{pipeline}": client.get_inference_statistics(f"{stage}_p{pipeline}").model_stats[0]
                .inference_count for stage in STAGES for pipeline in (0, 1)}


def wait_pipeline_idle(server, pipeline: int | None, timeout_s: float = 10.0) -> dict:
    """Poll until nothing is held on ``pipeline`` (None: anywhere): no active request, KV block, pending frame or
    vocoder stream in its stages' series (or fail naming what is held)."""
    held_metrics = ("omni_active_requests", "omni_kv_blocks_used", "omni_pending_audio_frames", "omni_code2wav_streams")
    deadline = time.monotonic() + timeout_s
    while True:
        values = series(server)
        held = {key: value for key, value in values.items() if key[0] in held_metrics and value
                and (pipeline is None or f'pipeline="{pipeline}"' in key[1])}
        if not held:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"pipeline {pipeline} still holds state after {timeout_s} s: {held}")
        time.sleep(0.1)


def test_each_pipeline_has_its_own_models_orchestrator_and_series(pipelines):
    assert sorted(pipelines.server.repository_models()) == sorted(
        ["omni", "preprocess", "orchestrator"] + [f"{stage}_p{p}" for stage in STAGES for p in (0, 1)])
    # one orchestrator process per pipeline
    stubs = find_stub_instances(pipelines.server.process.pid, ["orchestrator"])["orchestrator"]
    assert sorted(stubs) == ["orchestrator_p0_0", "orchestrator_p1_0"] and len(set(stubs.values())) == 2
    values = series(pipelines)
    for stage in ("thinker", "talker"):
        assert sorted(per_pipeline(values, "omni_kv_blocks_free", stage)) == [0, 1]
    assert sorted(per_pipeline(values, "omni_code2wav_decoded_frames_total")) == [0, 1]
    # each orchestrator instance reports its own pipeline's series, and no unlabelled totals (sum over pipeline)
    for metric in ("omni_active_requests", "omni_admission_queue_length", "omni_interstage_host_tensors_total"):
        assert sorted(per_pipeline(values, metric, "orchestrator")) == [0, 1], metric
    assert [key for key in values if 'stage="orchestrator"' in key[1] and "pipeline=" not in key[1]] == []
    log = pipelines.server.log_path.read_text(errors="replace")
    # python_backend's words for a metric or family it could not create, set or delete
    assert not re.findall(r"^.*(?:when (?:creating|deleting) Metric|metric value|MetricFamily).*$", log, re.M)


def test_concurrent_streams_spread_over_both_pipelines_and_equal_the_inprocess_pipeline(pipelines, inprocess):
    before, frames_before = inference_counts(pipelines), series(pipelines)
    check_concurrent_streams(pipelines, inprocess)
    after, frames_after = inference_counts(pipelines), wait_pipeline_idle(pipelines, None)
    for stage in STAGES:  # every stage of both pipelines served some of the 16 streams
        served = [after[f"{stage}_p{p}"] - before[f"{stage}_p{p}"] for p in (0, 1)]
        assert min(served) > 0, (stage, served)
    threads = [after[f"thinker_p{p}"] - before[f"thinker_p{p}"] for p in (0, 1)]
    assert sum(threads) == len(PROMPTS) and min(threads) >= len(PROMPTS) // 4, threads  # taken in turn: about even
    decoded = {p: frames - per_pipeline(frames_before, "omni_code2wav_decoded_frames_total")[p]
               for p, frames in per_pipeline(frames_after, "omni_code2wav_decoded_frames_total").items()}
    assert len(decoded) == 2 and all(value > 0 for value in decoded.values()), decoded


def test_one_seed_gives_one_audio_on_either_pipeline(pipelines):
    """One request at a time with one seed until each pipeline served one (Triton hands each to whichever orchestrator
    instance is free): both pipelines sample the same text and audio."""
    sampled = dict(temperature=0.9, top_k=20, max_tokens=12, max_audio_frames=24, seed=7)
    results = {}
    for _ in range(8):
        before = inference_counts(pipelines)
        result = stream(pipelines, PROMPTS[2], **sampled)
        results.setdefault(served_pipeline(before, inference_counts(pipelines)), result)
        if len(results) == 2:
            break
    assert sorted(results) == [0, 1], f"8 requests in a row all went to pipeline {list(results)}"
    first, second = results[0], results[1]
    assert first.text and first.text == second.text
    assert first.audio.size and first.audio.size == second.audio.size
    np.testing.assert_allclose(first.audio, second.audio, atol=1e-4)
    wait_pipeline_idle(pipelines, None)


def cancel_at_first_audio_after(server, other_controls: int, text: str, **scalars) -> None:
    """``cancel_at_first_audio``, with ``other_controls`` cancels of ids nobody holds sent between the request and
    its cancel: Triton hands requests to the orchestrator instances in turn when they are all free, so a request's
    cancel sent right after it reaches the other instance, and after one more control request the same one."""
    client = OmniStreamClient(server.grpc_url)
    first_audio = []

    def on_audio(chunk):
        if not first_audio:
            first_audio.append(chunk)
            with server.server.grpc_client() as other:
                for index in range(other_controls):
                    send_cancel(other, f"{NOBODY}-{index}")
            client.cancel()

    try:
        with pytest.raises(StreamError, match="CANCELLED"):
            client.stream(text, on_audio=on_audio, **scalars)
    finally:
        client.client.close()
    assert first_audio, "the request was cancelled before it produced audio"


def test_a_cancel_frees_the_pipeline_that_holds_the_request_whichever_instance_it_reaches(pipelines):
    """A long request runs on one pipeline; short ones are cancelled at their first audio (``OmniStreamClient.cancel``:
    its control request by request id, which Triton hands to either orchestrator instance) until cancels reached both
    the instance that holds the request and the other one (the trace says which). Each cancelled request ends while
    the long one streams on; cancelling that one too leaves nothing held anywhere."""
    trace_dir = pipelines.server.log_path.parent / "trace"
    started = time.monotonic()
    long_client = OmniStreamClient(pipelines.grpc_url)
    long_audio, long_error = [], []

    def long_request():
        try:
            long_client.stream("a long one", max_tokens=4, max_audio_frames=4000, min_audio_frames=4000,
                               ignore_eos=True, temperature=0.0, timeout_s=120,
                               on_audio=lambda chunk: long_audio.append(chunk.size))
        except Exception as error:  # the cancel below ends it
            long_error.append(error)

    def routings() -> set[bool]:
        """Whether each cancel since the test began reached an instance holding its request."""
        return {bool(record["held"]) for record in trace.read_records(trace_dir, "orchestrator_cancel")
                if record["t"] >= started and not record["client_id"].startswith(NOBODY)}

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while not long_audio:
            assert time.monotonic() < deadline and runner.is_alive(), "the long request produced no audio"
            time.sleep(0.05)
        active = per_pipeline(series(pipelines), "omni_active_requests", "orchestrator")
        (long_pipeline,) = [p for p, value in active.items() if value == 1.0]
        for attempt in range(12):
            cancel_at_first_audio_after(pipelines, attempt % 2, "cancel me", max_tokens=60, max_audio_frames=4000,
                                        min_audio_frames=4000, ignore_eos=True, temperature=0.0, timeout_s=60)
            deadline = time.monotonic() + 10  # the cancelled one ends (it would stream 4000 frames otherwise)
            while per_pipeline(series(pipelines), "omni_active_requests", "orchestrator") != {
                    long_pipeline: 1.0, 1 - long_pipeline: 0.0}:
                assert time.monotonic() < deadline, "a cancelled request still runs"
                time.sleep(0.1)
            if routings() == {True, False}:
                break
        assert routings() == {True, False}, f"12 cancels all reached {'the holder' if True in routings() else 'the other'}"
        values = wait_pipeline_idle(pipelines, 1 - long_pipeline)
        assert runner.is_alive(), "the long request ended with a cancel of another"
        # the long request's talker still holds its KV blocks (its thinker is done after 4 tokens)
        assert per_pipeline(values, "omni_kv_blocks_used", "talker")[long_pipeline] > 0
    finally:
        long_client.cancel()
        runner.join(timeout=30)
        long_client.client.close()
    assert long_error and not runner.is_alive()
    wait_pipeline_idle(pipelines, None)
    assert stream(pipelines, "after cancel", max_tokens=4, max_audio_frames=4, temperature=0.0).audio.size


def test_a_dead_stage_closes_its_pipeline_and_the_other_serves_on(pipelines):
    """Last here: it kills pipeline 1's thinker (no --allow-stage-reload: it stays down). Pipeline 0's orchestrator
    instance serves on; pipeline 1's refuses what Triton hands it with UNAVAILABLE naming the stage (a retry may land
    on pipeline 0), and nothing more reaches pipeline 1's stages."""
    import os
    import signal

    from omni_triton.shared.stub_processes import stub_alive

    server_pid = pipelines.server.process.pid
    (victim,) = find_stub_instances(server_pid, ["thinker_p1"])["thinker_p1"].values()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stub_alive(victim, server_pid):
        assert time.monotonic() < deadline, "the killed stub is still alive"
        time.sleep(0.05)
    before = inference_counts(pipelines)
    served, refused = [], []
    for prompt in PROMPTS[:8]:  # one at a time: each goes to either instance
        try:
            served.append(stream(pipelines, prompt, max_tokens=6, max_audio_frames=8, temperature=0.0))
        except StreamError as error:
            refused.append(error)
        if served and refused:
            break
    assert served and all(result.text and result.audio.size for result in served)
    assert refused and all(error.code == "UNAVAILABLE" and "thinker_p1 stage" in error.message()
                           for error in refused), [str(error) for error in refused]
    after = inference_counts(pipelines)
    assert after["thinker_p0"] - before["thinker_p0"] == len(served) and after["talker_p1"] == before["talker_p1"]
