"""A real tritonserver serving a model config with seeded random weights and no checkpoint on disk
(`--load-format dummy`): text and audio stream through the `omni` ensemble and equal the in-process pipeline
built from the same seed, and `omni-triton bench` drives that server and the in-process baseline.

The config is the tiny checkpoint's (a full-size one needs a GPU), written to a config-only dir by
omni_triton.checkpoints.dummy as `serve --config` writes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TEST_LIMITS
from omni_triton.client import OmniStreamClient
from server_fixture import serving

pytestmark = pytest.mark.server

SEED = 5  # not the default 0: equal output in and out of the server shows the seed reached every stage
PROMPT = "Tell me a story."
GREEDY = dict(temperature=0.0, repetition_penalty=1.0, max_tokens=10, max_audio_frames=16)


@pytest.fixture(scope="module")
def dummy_dir(tiny_checkpoint, tmp_path_factory):
    from omni_triton.checkpoints.dummy import build

    return build(tiny_checkpoint, tmp_path_factory.mktemp("dummy") / "tiny")


@pytest.fixture(scope="module")
def server(dummy_dir, tmp_path_factory):
    with serving(dummy_dir, tmp_path_factory.mktemp("dummy-triton"), load_format="dummy", dummy_seed=SEED,
                 **TEST_LIMITS) as handle:
        yield handle


def test_random_weights_stream_text_and_audio_as_the_inprocess_pipeline(server, dummy_dir):
    from omni_triton.pipeline.inprocess import InProcessPipeline

    assert not list(dummy_dir.glob("*.safetensors*"))
    with OmniStreamClient(server.grpc_url) as client:
        served = client.stream(PROMPT, timeout_s=120, **GREEDY)
    assert served.text and served.audio.size > 0
    pipeline = InProcessPipeline(dummy_dir, load_format="dummy", seed=SEED)
    try:
        text, audio = pipeline.generate({
            "TEXT": np.array([PROMPT.encode()], dtype=np.object_), "TEMPERATURE": np.array([0.0], np.float32),
            "REPETITION_PENALTY": np.array([1.0], np.float32), "MAX_TOKENS": np.array([10], np.int32),
            "MAX_AUDIO_FRAMES": np.array([16], np.int32)})
    finally:
        pipeline.close()
    assert served.text == text
    np.testing.assert_allclose(served.audio, audio, atol=1e-4)


def test_bench_drives_the_dummy_server_and_the_inprocess_baseline(server, dummy_dir, tmp_path):
    from omni_triton.bench.cli import main

    out = tmp_path / "report"
    code = main(["--url", server.grpc_url, "--checkpoint", str(dummy_dir), "--load-format", "dummy",
                 "--dummy-seed", str(SEED), "--quick", "--systems", "server,inprocess,transformers",
                 "--concurrency", "1", "--requests-per-level", "2", "--warmup", "0", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert report["weights"] == {"checkpoint": str(dummy_dir), "load_format": "dummy", "seed": SEED}
    # transformers runs on random weights too: the served stages' tensors, built from the same config and seed
    assert {row["system"] for row in report["results"]} == {"server", "inprocess", "transformers"}
    assert any(note.startswith("transformers: random weights") for note in report["notes"])
    for row in report["results"]:
        assert row["failed"] == 0 and row["ttfa_p50"] > 0 and row["continuity"] is not None
        assert "gpu_memory_peak_gib" in row  # None on a machine without nvidia-smi
    assert "gpu_memory_used_gib_at_start" in report
