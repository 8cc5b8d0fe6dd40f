"""Two whole pipelines in one real tritonserver (`serve --pipelines 2`, on the CPU): each stage is rendered once per
pipeline (thinker_p0, thinker_p1, ...), concurrent requests spread over both and get the in-process pipeline's
output, one seed gives one audio on either pipeline, the metrics say what each pipeline holds, and a cancel frees
the pipeline that holds the request while the other goes on."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omni_triton.client import OmniStreamClient
from omni_triton.shared.placement import Placement
from server_fixture import serving
from test_server_pipeline import (PROMPTS, cancel_at_first_audio, check_concurrent_streams, inprocess,  # noqa: F401
                                  stream)
from test_server_replicas import series

pytestmark = pytest.mark.server

STAGES = ("thinker", "talker", "code2wav")


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint, tmp_path_factory):
    with serving(tiny_checkpoint, tmp_path_factory.mktemp("pipelines"), placement=Placement(pipelines=2),
                 max_audio_frames_cap=4096) as handle:
        yield handle


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


def test_each_pipeline_has_its_own_models_and_series(pipelines):
    assert sorted(pipelines.server.repository_models()) == sorted(
        ["omni", "preprocess", "orchestrator"] + [f"{stage}_p{p}" for stage in STAGES for p in (0, 1)])
    values = series(pipelines)
    for stage in ("thinker", "talker"):
        assert sorted(per_pipeline(values, "omni_kv_blocks_free", stage)) == [0, 1]
    assert sorted(per_pipeline(values, "omni_code2wav_decoded_frames_total")) == [0, 1]
    # the orchestrator: the server's totals, unlabelled, and each pipeline's own
    assert ("omni_active_requests", 'stage="orchestrator"') in values
    assert sorted(per_pipeline(values, "omni_active_requests", "orchestrator")) == [0, 1]


def test_concurrent_streams_spread_over_both_pipelines_and_equal_the_inprocess_pipeline(pipelines, inprocess):
    before, frames_before = inference_counts(pipelines), series(pipelines)
    check_concurrent_streams(pipelines, inprocess)
    after, frames_after = inference_counts(pipelines), wait_pipeline_idle(pipelines, None)
    for stage in STAGES:  # every stage of both pipelines served some of the 16 streams
        served = [after[f"{stage}_p{p}"] - before[f"{stage}_p{p}"] for p in (0, 1)]
        assert min(served) > 0, (stage, served)
    threads = [after[f"thinker_p{p}"] - before[f"thinker_p{p}"] for p in (0, 1)]
    assert sum(threads) == len(PROMPTS) and min(threads) >= len(PROMPTS) // 4, threads  # least loaded: balanced
    decoded = {p: frames - per_pipeline(frames_before, "omni_code2wav_decoded_frames_total")[p]
               for p, frames in per_pipeline(frames_after, "omni_code2wav_decoded_frames_total").items()}
    assert len(decoded) == 2 and all(value > 0 for value in decoded.values()), decoded


def test_one_seed_gives_one_audio_on_either_pipeline(pipelines):
    """Two requests at once with one seed: the second goes to the other pipeline (the least loaded), and both
    pipelines sample the same text and audio."""
    sampled = dict(temperature=0.9, top_k=20, max_tokens=12, max_audio_frames=24, seed=7)
    before = inference_counts(pipelines)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: stream(pipelines, PROMPTS[2], **sampled), range(2))
    after = inference_counts(pipelines)
    assert [after[f"thinker_p{p}"] - before[f"thinker_p{p}"] for p in (0, 1)] == [1, 1]
    assert first.text and first.text == second.text
    assert first.audio.size and first.audio.size == second.audio.size
    np.testing.assert_allclose(first.audio, second.audio, atol=1e-4)
    wait_pipeline_idle(pipelines, None)


def test_a_cancel_frees_the_pipeline_that_holds_the_request_and_the_other_goes_on(pipelines):
    """A long request runs on pipeline 0 (both idle: the lowest index); a second one goes to pipeline 1 and is
    cancelled at its first audio, its thinker most likely still writing. Pipeline 1 then holds nothing (its thinker
    and talker freed their KV blocks, its vocoder its stream) while pipeline 0 still streams; cancelling that one
    frees pipeline 0."""
    long_client = OmniStreamClient(pipelines.grpc_url)
    long_audio, long_error = [], []

    def long_request():
        try:
            long_client.stream("a long one", max_tokens=4, max_audio_frames=4000, min_audio_frames=4000,
                               ignore_eos=True, temperature=0.0, timeout_s=120,
                               on_audio=lambda chunk: long_audio.append(chunk.size))
        except Exception as error:  # the cancel below ends it
            long_error.append(error)

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while not long_audio:
            assert time.monotonic() < deadline and runner.is_alive(), "the long request produced no audio"
            time.sleep(0.05)
        assert per_pipeline(series(pipelines), "omni_active_requests", "orchestrator") == {0: 1.0, 1: 0.0}
        cancel_at_first_audio(pipelines, "cancel me", max_tokens=60, max_audio_frames=4000, min_audio_frames=4000,
                              ignore_eos=True, temperature=0.0, timeout_s=60)
        values = wait_pipeline_idle(pipelines, 1)
        assert runner.is_alive(), "the long request on pipeline 0 ended with the cancel"
        # pipeline 0's talker still holds its request's KV blocks (its thinker is done after 4 tokens)
        assert per_pipeline(values, "omni_kv_blocks_used", "talker")[0] > 0
        assert per_pipeline(values, "omni_active_requests", "orchestrator") == {0: 1.0, 1: 0.0}
    finally:
        long_client.cancel()
        runner.join(timeout=30)
        long_client.client.close()
    assert long_error and not runner.is_alive()
    wait_pipeline_idle(pipelines, None)
    assert stream(pipelines, "after cancel", max_tokens=4, max_audio_frames=4, temperature=0.0).audio.size


def test_a_dead_stage_closes_its_pipeline_and_the_other_serves_on(pipelines):
    """Last here: it kills pipeline 1's thinker (no --allow-stage-reload: it stays down). New requests all go to
    pipeline 0 and succeed, where one pipeline would refuse every request until the stage is reloaded."""
    import os
    import signal

    from omni_triton.shared.stub_processes import find_stub_instances, stub_alive

    server_pid = pipelines.server.process.pid
    (victim,) = find_stub_instances(server_pid, ["thinker_p1"])["thinker_p1"].values()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stub_alive(victim, server_pid):
        assert time.monotonic() < deadline, "the killed stub is still alive"
        time.sleep(0.05)
    before = inference_counts(pipelines)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda prompt: stream(pipelines, prompt, max_tokens=6, max_audio_frames=8,
                                                      temperature=0.0), PROMPTS[:3]))
    assert all(result.text and result.audio.size for result in results)
    after = inference_counts(pipelines)
    assert after["thinker_p0"] - before["thinker_p0"] == 3 and after["talker_p1"] == before["talker_p1"]
