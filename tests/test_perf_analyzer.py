"""perf_analyzer against a real tritonserver on the tiny checkpoint: `omni` over gRPC streams (every request
succeeds and streams audio; TTFA read from the profile export), and each stage model on its own input data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni_triton.bench.perf_analyzer import (PerfAnalyzerUnavailable, check_perf_analyzer, find_perf_analyzer,
                                             request_records, run_point)
from omni_triton.bench.perf_inputs import stage_inputs, write_stage_inputs
from omni_triton.bench.workload import QUICK


@pytest.fixture(scope="module")
def perf_analyzer():
    try:
        binary = find_perf_analyzer()
        check_perf_analyzer(binary)
    except PerfAnalyzerUnavailable as error:
        pytest.skip(f"perf_analyzer cannot run here: {error}")
    return binary


@pytest.fixture(scope="module")
def inputs_dir(tiny_checkpoint, tmp_path_factory):
    return tmp_path_factory.mktemp("perf_inputs")


def test_stage_inputs_match_the_checkpoint(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    hidden = config["thinker_config"]["text_config"]["hidden_size"]
    groups = config["talker_config"]["num_code_groups"]
    data = stage_inputs(tiny_checkpoint, QUICK)
    (talker,), = data["talker"]["data"]  # one stream of one step: START and END on the same request
    rows = len(talker["ROW_IDS"]["content"])
    assert talker["EMBEDS"]["shape"] == [rows, hidden] and len(talker["EMBEDS"]["content"]) == rows * hidden
    assert rows == talker["PROMPT_LEN"]["content"][0] + QUICK.thinker_tokens
    assert talker["MAX_AUDIO_FRAMES"]["content"] == [QUICK.audio_frames]
    (thinker,) = data["thinker"]["data"]
    assert thinker["INPUT_IDS"]["content"][:talker["PROMPT_LEN"]["content"][0]] == \
        talker["ROW_IDS"]["content"][:talker["PROMPT_LEN"]["content"][0]]
    (code2wav,) = data["code2wav"]["data"]
    assert code2wav["CODES"]["shape"] == [groups, QUICK.audio_frames]
    assert np.max(code2wav["CODES"]["content"]) < config["code2wav_config"]["codebook_size"]


@pytest.mark.server
def test_omni_streams_under_perf_analyzer(triton_server, perf_analyzer, tiny_checkpoint, inputs_dir, tmp_path):
    paths = write_stage_inputs(tiny_checkpoint, QUICK, inputs_dir)
    summary, export_file = run_point(perf_analyzer, "omni", triton_server.grpc_url, paths["omni"], tmp_path,
                                     concurrency=2, requests=4, timeout_s=300)
    records, source = request_records(json.loads(export_file.read_text()))
    assert source == "AUDIO outputs"
    assert summary.requests == len(records) == 4
    assert all(r.ttfa_s is not None and r.ttft_s is not None for r in records), "a request streamed no audio"
    assert all(r.latency_first_s <= r.ttfa_s <= r.latency_last_s for r in records)
    assert all(r.responses > 2 for r in records)  # text deltas and audio chunks, streamed


@pytest.mark.server
@pytest.mark.parametrize("model", ["preprocess", "thinker", "talker", "code2wav"])
def test_stage_model_under_perf_analyzer(triton_server, perf_analyzer, tiny_checkpoint, inputs_dir, tmp_path, model):
    paths = write_stage_inputs(tiny_checkpoint, QUICK, inputs_dir)
    summary, _ = run_point(perf_analyzer, model, triton_server.grpc_url, paths[model], tmp_path,
                           concurrency=1, requests=2, timeout_s=300)
    assert summary.requests == 2 and summary.last_response_p50_s is not None
