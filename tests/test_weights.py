"""Checkpoint config + streaming loader: sharded/single files, stacked experts, strict errors naming tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_triton.checkpoints.tiny import build
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_talker, load_thinker, load_thinker_embedding_rows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def tensors(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _variant(tmp_path: Path, checkpoint: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint whose single safetensors file holds ``tensors``."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, tmp_path / name)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_config_reads_released_keys(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    config = OmniConfig.from_pretrained(checkpoint)
    talker_text = raw["talker_config"]["text_config"]
    assert config.talker.text.num_experts == talker_text.get("num_experts", talker_text.get("num_local_experts"))
    assert config.talker.text.shared_expert_intermediate_size == talker_text["shared_expert_intermediate_size"]
    thinker_rope = raw["thinker_config"]["text_config"]["rope_parameters"]
    assert config.thinker.text.mrope_section == tuple(thinker_rope["mrope_section"])
    assert config.talker.code_predictor.mrope_section is None
    assert config.accept_hidden_layer == raw["talker_config"]["accept_hidden_layer"]
    assert config.speaker_codec_id("Ethan") == raw["talker_config"]["speaker_id"]["ethan"]
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert config.thinker_eos_token_ids == tuple(generation["eos_token_id"])
    with pytest.raises(ValueError, match="speaker='nobody'"):
        config.speaker_codec_id("nobody")


def test_experts_are_stacked_from_per_expert_tensors(checkpoint, tensors):
    thinker = load_thinker(checkpoint, with_audio=False)
    experts = thinker.model.layers[1].mlp.experts
    intermediate = experts.down_proj.shape[-1]
    prefix = "thinker.model.layers.1.mlp.experts.5."
    assert torch.equal(experts.gate_up_proj[5, :intermediate], tensors[prefix + "gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[5, intermediate:], tensors[prefix + "up_proj.weight"])
    assert torch.equal(experts.down_proj[5], tensors[prefix + "down_proj.weight"])


def test_sharded_save_pretrained_checkpoint_loads_identically(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    shutil.copy(checkpoint / "generation_config.json", tmp_path / "generation_config.json")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    for load in (lambda d: load_thinker(d, with_audio=False), load_talker):
        single, sharded = _state(load(checkpoint)), _state(load(tmp_path))
        assert single.keys() == sharded.keys()
        assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_loads_to_requested_dtype(checkpoint, tensors):
    talker = load_talker(checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in talker.parameters()} == {torch.bfloat16}
    assert torch.equal(talker.codec_head.weight, tensors["talker.codec_head.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("name", ["talker.model.layers.1.self_attn.k_norm.weight",
                                  "talker.model.layers.0.mlp.experts.3.up_proj.weight",
                                  "talker.code_predictor.lm_head.2.weight"])
def test_missing_tensor_is_named(checkpoint, tensors, tmp_path, name):
    broken = _variant(tmp_path, checkpoint, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(ValueError, match="missing") as error:
        load_talker(broken)
    assert name in str(error.value)


@pytest.mark.parametrize("name", ["talker.model.layers.0.self_attn.bogus.weight",
                                  "talker.model.layers.0.mlp.experts.99.gate_proj.weight",
                                  "thinker.model.layers.9.input_layernorm.weight"])
def test_unexpected_tensor_is_named(checkpoint, tensors, tmp_path, name):
    broken = _variant(tmp_path, checkpoint, {**tensors, name: torch.zeros(4)})
    with pytest.raises(ValueError, match="unexpected") as error:
        load_talker(broken) if name.startswith("talker.") else load_thinker(broken, with_audio=False)
    assert name in str(error.value)


def test_other_components_tensors_are_ignored(checkpoint, tensors, tmp_path):
    """code2wav.* / thinker.visual.* (present in every checkpoint) and strays of other components load fine."""
    assert any(k.startswith("code2wav.") for k in tensors) and any(k.startswith("thinker.visual.") for k in tensors)
    variant = _variant(tmp_path, checkpoint, {**tensors, "code2wav.stray.weight": torch.zeros(2)})
    load_talker(variant)
    load_thinker(variant, with_audio=False)


@pytest.mark.parametrize("name", ["thinker.model.layers.0.self_attn.q_proj.weight",
                                  "thinker.model.layers.2.mlp.experts.1.down_proj.weight"])
def test_misshaped_tensor_is_named(checkpoint, tensors, tmp_path, name):
    wrong = torch.zeros(tensors[name].shape[0] + 1, *tensors[name].shape[1:])
    broken = _variant(tmp_path, checkpoint, {**tensors, name: wrong})
    with pytest.raises(ValueError, match="shape") as error:
        load_thinker(broken, with_audio=False)
    assert name in str(error.value)


def test_embedding_rows_without_loading_the_thinker(checkpoint):
    config = OmniConfig.from_pretrained(checkpoint)
    ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
    thinker = load_thinker(checkpoint, with_audio=False)
    assert torch.equal(load_thinker_embedding_rows(checkpoint, ids), thinker.embed(torch.tensor(ids)))
    with pytest.raises(ValueError, match="token id 99999"):
        load_thinker_embedding_rows(checkpoint, [99999])
