"""Two talker and two code2wav instances in one real tritonserver (`serve --instances talker=2,code2wav=2`, on
the CPU: KIND_CPU count 2): concurrent streams each get the in-process pipeline's output, both replicas of each
stage do work, and a cancel reaches the talker instance that holds the request, also after the thinker
finished (its sequence stays open until the frames stream ends)."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_triton.client import OmniStreamClient
from omni_triton.shared.placement import Placement
from server_fixture import serving
from test_server_pipeline import (PROMPTS, check_concurrent_streams, inprocess, stream,  # noqa: F401 (fixture)
                                  wait_idle)

pytestmark = pytest.mark.server

REPLICAS = Placement(instances={"talker": 2, "code2wav": 2})


@pytest.fixture(scope="module")
def replicated(tiny_checkpoint, tmp_path_factory):
    with serving(tiny_checkpoint, tmp_path_factory.mktemp("replicas"), placement=REPLICAS,
                 max_audio_frames_cap=4096) as handle:
        yield handle


def series(server) -> dict[tuple[str, str], float]:
    """(metric, labels) -> value of every omni_* series (replicas carry a model_instance label)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {(name, labels): float(value) for name, labels, value in re.findall(r"^(omni_\w+)\{([^}]*)\} (\S+)$", text,
                                                                                 re.M)}


def per_instance(values: dict, metric: str, model: str) -> dict[str, float]:
    found = {}
    for (name, labels), value in values.items():
        instance = re.search(r'model_instance="(%s_\w+)"' % model, labels)
        if name == metric and instance:
            found[instance.group(1)] = value
    return found


def test_each_replica_reports_its_own_series(replicated):
    values = series(replicated)
    assert sorted(per_instance(values, "omni_kv_blocks_free", "talker")) == ["talker_0_0", "talker_0_1"]
    assert sorted(per_instance(values, "omni_code2wav_decoded_frames_total", "code2wav")) == [
        "code2wav_0_0", "code2wav_0_1"]
    assert ("omni_kv_blocks_free", 'stage="thinker"') in values  # one instance: no model_instance label


def test_concurrent_streams_over_replicas_equal_the_inprocess_pipeline(replicated, inprocess):
    before = series(replicated)
    check_concurrent_streams(replicated, inprocess)
    after = wait_idle(replicated, timeout_s=10.0, read=series)
    # both vocoder replicas decoded frames, and both talkers held KV blocks at some point (their free count
    # is back where it was, so look at the vocoder counters and at the talker stubs' CPU time instead)
    decoded = {name: value - per_instance(before, "omni_code2wav_decoded_frames_total", "code2wav")[name]
               for name, value in per_instance(after, "omni_code2wav_decoded_frames_total", "code2wav").items()}
    assert len(decoded) == 2 and all(frames > 0 for frames in decoded.values()), decoded


def test_both_talker_replicas_serve_streams(replicated):
    cpu = _stub_cpu_seconds(replicated, "talker")
    assert len(cpu) == 2, cpu
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda prompt: stream(replicated, prompt, max_tokens=8, max_audio_frames=40,
                                            min_audio_frames=40, ignore_eos=True, temperature=0.0), PROMPTS[:4]))
    busy = {name: seconds - cpu[name] for name, seconds in _stub_cpu_seconds(replicated, "talker").items()}
    # each talker generated frames for some of the streams: far more CPU than an idle stub's metrics thread
    assert min(busy.values()) > 0.25 * max(busy.values()), busy


def _stub_cpu_seconds(server, model: str) -> dict[str, float]:
    from omni_triton.shared.stub_processes import find_stub_instances

    ticks = __import__("os").sysconf("SC_CLK_TCK")
    found = {}
    for name, pid in find_stub_instances(server.server.process.pid, [model]).get(model, {}).items():
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        found[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return found


def test_cancel_after_the_thinker_finished_reaches_the_holding_talker(replicated):
    """The thinker ends after 2 tokens; each talker would then go on for 4000 frames. Cancelling on the first
    audio must free the talker instance that holds the request, whichever it is, four times over (an abort
    sent as a new sequence lands on either instance: all four right by chance is 1 in 16)."""
    for attempt in range(4):
        client = OmniStreamClient(replicated.grpc_url)
        first_audio = []
        try:
            with pytest.raises(Exception):
                client.stream(f"cancel {attempt}", max_tokens=2, max_audio_frames=4000, min_audio_frames=4000,
                              ignore_eos=True, temperature=0.0, timeout_s=60,
                              on_audio=lambda chunk: (first_audio.append(chunk), client.cancel()))
        finally:
            client.client.close()
        assert first_audio, "the request was cancelled before it produced audio"
        values = wait_idle(replicated, timeout_s=10.0, read=series)
        used = defaultdict(float)
        for name, value in per_instance(values, "omni_kv_blocks_used", "talker").items():
            used[name] += value
        assert set(used) == {"talker_0_0", "talker_0_1"} and not any(used.values()), used
    assert stream(replicated, "after cancel", max_tokens=4, max_audio_frames=4, temperature=0.0).audio.size


def test_a_talker_done_before_the_thinker_takes_no_more_chunks(replicated):
    """Two frames end the talker's stream (and its sequence) while the thinker still streams text: the thinker
    chunks after that are not sent to the ended sequence (Triton would refuse them without START)."""
    for attempt in range(3):
        result = stream(replicated, f"short audio, long text {attempt}", max_tokens=48, ignore_eos=True,
                        max_audio_frames=2, temperature=0.0)
        assert result.text and result.audio.size == 2 * 1920 - 555
    wait_idle(replicated, timeout_s=10.0, read=series)
