"""The `transformers` bench baseline with random weights (`omni-triton bench --config ...`): built from
config.json alone, seeded, the served stages' tensors, and generate(return_audio=True) gives the workload's
exact audio length. CPU, the tiny checkpoint's config; no server."""

from __future__ import annotations

import argparse

import pytest
import torch

from omni_triton.bench.cli import make_runner
from omni_triton.bench.runners.transformers_generate import build_random_model, served_name
from omni_triton.bench.workload import QUICK, client_tensors, prompt_text, with_overrides
from omni_triton.models.code2wav.vocoder import Code2Wav
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_code2wav, load_talker, load_thinker
from omni_triton.launch.options import ModelSource

SEED = 3


@pytest.fixture(scope="module")
def random_model(tiny_checkpoint):
    return build_random_model(tiny_checkpoint, torch.device("cpu"), torch.float32, SEED)


def _served_key(name: str) -> tuple[str, str] | None:
    """transformers' parameter -> (served component, its state-dict key); None for the vision tower."""
    if ".visual." in name:
        return None
    if ".audio_tower." in name:  # the served thinker holds its audio encoder as `audio_encoder`
        return "thinker", "audio_encoder." + served_name(name)
    return name.split(".", 1)[0], served_name(name)


def test_random_weights_are_the_served_stages_tensors(random_model, tiny_checkpoint):
    served = {
        "thinker": dict(load_thinker(tiny_checkpoint, load_format="dummy", seed=SEED).named_parameters()),
        "talker": dict(load_talker(tiny_checkpoint, load_format="dummy", seed=SEED).named_parameters()),
        "code2wav": dict(load_code2wav(tiny_checkpoint, load_format="dummy", seed=SEED).named_parameters()),
    }
    compared = set()
    for name, parameter in random_model.named_parameters():
        assert torch.isfinite(parameter).all(), name  # nothing left uninitialised
        key = _served_key(name)
        if key is None:
            continue
        component, served_key = key
        assert served_key in served[component], f"{name} -> {key}: no such served parameter"
        assert torch.equal(parameter, served[component][served_key]), name
        compared.add(key)
    # every served parameter has its transformers twin
    assert compared == {(component, key) for component, parameters in served.items() for key in parameters}


def test_the_seed_decides_the_weights(random_model, tiny_checkpoint):
    again = build_random_model(tiny_checkpoint, torch.device("cpu"), torch.float32, SEED)
    other = build_random_model(tiny_checkpoint, torch.device("cpu"), torch.float32, SEED + 1)
    for (name, a), b, c in zip(random_model.state_dict().items(), again.state_dict().values(),
                               other.state_dict().values()):
        assert torch.equal(a, b), name
    embedding = "thinker.model.language_model.embed_tokens.weight"
    assert not torch.equal(random_model.state_dict()[embedding], other.state_dict()[embedding])


def test_bench_builds_the_random_baseline_and_generate_returns_the_frames_asked(tiny_checkpoint):
    args = argparse.Namespace(checkpoint=tiny_checkpoint, device="cpu",
                              source=ModelSource(tiny_checkpoint, load_format="dummy", seed=SEED))
    runner = make_runner("transformers", args, url="unused", workload=QUICK, notes=[])
    workload = with_overrides(QUICK, audio_frames=9)
    timing = runner.request(client_tensors(workload, prompt_text(workload.prompt_tokens,
                                                                 tiny_checkpoint / "tokenizer.json")))
    assert timing.ok, timing.error
    # one event at the end (not streaming): TTFT = TTFA = end to end
    assert len(timing.text_times) == 1 and len(timing.audio_chunks) == 1
    config = OmniConfig.from_pretrained(tiny_checkpoint).code2wav
    # the served stages' one-pass length for these frames: N frames x samples per frame, less the vocoder's trim
    expected = workload.audio_frames * Code2Wav.samples_per_frame_for(config) - Code2Wav.trim_samples_for(config)
    assert timing.audio_chunks[0][1] == expected
    runner.close()
