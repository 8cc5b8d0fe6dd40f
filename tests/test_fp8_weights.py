"""Block-FP8 weights: the format's math, FP8 checkpoints written by transformers' FP8 writer, quantizing at load.

The tiny FP8 checkpoint is the tiny checkpoint rewritten by ``build_engines.fp8_checkpoint`` (transformers'
``Fp8Quantize``, 32 x 32 blocks: its writer only quantizes weights the block tiles) and read back through
transformers (which dequantizes FP8 on a machine without a GPU) for the logits parity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from build_engines.fp8_checkpoint import write_fp8_checkpoint
from omni_triton.checkpoints.tiny import build
from omni_triton.models.layers.attention import contiguous_batch
from omni_triton.models.layers.fp8 import Fp8Experts, Fp8Linear, activation_dtype
from omni_triton.models.quantization import FP8_DTYPE, Fp8Scheme, dequantize_fp8, quantize_fp8
from omni_triton.models.weights import load_talker, load_thinker

transformers = pytest.importorskip("transformers")
BLOCK = (32, 32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    source = build(tmp_path_factory.mktemp("tiny"), "tiny")
    return source, write_fp8_checkpoint(source, tmp_path_factory.mktemp("tiny-fp8"), BLOCK)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _rewrite(checkpoint: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``checkpoint`` copied to ``out`` with ``tensors`` as its weights."""
    save_file(tensors, out / "model.safetensors")
    for path in checkpoint.iterdir():
        if path.name != "model.safetensors":
            (out / path.name).write_bytes(path.read_bytes())


def test_quantize_matches_transformers_writer_bit_for_bit(checkpoints):
    source, fp8 = checkpoints
    full, written = _tensors(source), _tensors(fp8)
    quantized = [name for name, tensor in written.items() if tensor.dtype == FP8_DTYPE]
    assert len(quantized) > 100
    for name in quantized:
        weight, scale_inv = quantize_fp8(full[name], BLOCK)
        assert torch.equal(weight.view(torch.uint8), written[name].view(torch.uint8)), name
        assert torch.equal(scale_inv, written[name + "_scale_inv"]), name


@pytest.mark.parametrize("shape", [(64, 64), (70, 45), (3, 100, 33)])
def test_dequantized_weight_is_within_fp8_rounding(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    quantized, scale_inv = quantize_fp8(weight, BLOCK)
    assert scale_inv.shape[-2:] == (-(-shape[-2] // 32), -(-shape[-1] // 32))  # partial blocks at the edge
    restored = dequantize_fp8(quantized, scale_inv, BLOCK)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element, well under it on average
    assert ((restored - weight).abs() <= weight.abs() * 2 ** -4 + 1e-12).all()
    assert 0 < float((restored - weight).norm() / weight.norm()) < 0.04


def test_fp8_checkpoint_loads_as_fp8_and_matches_transformers(checkpoints):
    source, fp8 = checkpoints
    thinker = load_thinker(fp8, with_audio=False)
    layer = thinker.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.experts, Fp8Experts)
    assert layer.self_attn.q_proj.weight.dtype == FP8_DTYPE and layer.mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert layer.mlp.gate.weight.dtype == torch.float32 and thinker.lm_head.weight.dtype == torch.float32
    # the stacked gate/up halves hold expert 3's gate_proj and up_proj, scales included
    written = _tensors(fp8)
    prefix = "thinker.model.layers.0.mlp.experts.3."
    gate_up, _ = layer.mlp.experts.dequantized(torch.float32)
    want = torch.cat([dequantize_fp8(written[prefix + p + ".weight"], written[prefix + p + ".weight_scale_inv"],
                                     BLOCK) for p in ("gate_proj", "up_proj")])
    assert torch.equal(gate_up[3], want)

    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(fp8, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)
    with torch.no_grad():
        expected = hf.thinker(input_ids=ids[None]).logits[0]
        batch = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                                 dtype=torch.float32)
        hidden, _ = thinker(thinker.embed(ids), torch.arange(len(ids))[None].expand(3, -1), batch)
        logits = thinker.compute_logits(hidden)
    assert (logits - expected).abs().max() <= 1e-4


def test_fp8_checkpoint_talker_is_served_dequantized_in_the_model_dtype(checkpoints, caplog):
    """The talker (and its code predictor) is served in the model dtype (``quantization.served_in_fp8``): an FP8
    checkpoint's talker tensors dequantized once at load, their block scales consumed, a log line naming the
    memory that costs; the thinker of the same checkpoint stays FP8."""
    _, fp8 = checkpoints
    with caplog.at_level("WARNING", logger="omni_triton.models.weights"):
        talker = load_talker(fp8, dtype=torch.bfloat16)
    assert {p.dtype for p in talker.parameters()} == {torch.bfloat16}
    written = _tensors(fp8)
    experts = talker.model.layers[1].mlp.experts
    inter = experts.gate_up_proj.shape[1] // 2
    for name, got in (("talker.model.layers.1.mlp.experts.2.up_proj", experts.gate_up_proj[2, inter:]),
                      ("talker.code_predictor.model.layers.0.self_attn.q_proj",
                       talker.code_predictor.model.layers[0].self_attn.q_proj.weight),
                      ("talker.model.layers.0.mlp.shared_expert.down_proj",
                       talker.model.layers[0].mlp.shared_expert.down_proj.weight)):
        assert written[name + ".weight"].dtype == FP8_DTYPE, name
        want = dequantize_fp8(written[name + ".weight"], written[name + ".weight_scale_inv"], BLOCK, torch.bfloat16)
        assert torch.equal(got, want), name
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("talker:")]
    # a byte more per weight the checkpoint has in FP8 (bf16: 2 bytes), less their fp32 scales
    talker_fp8 = sum(t.numel() for n, t in written.items() if n.startswith("talker.") and t.dtype == FP8_DTYPE)
    talker_scales = sum(t.numel() for n, t in written.items() if n.startswith("talker.") and n.endswith("_scale_inv"))
    assert talker_fp8 > 0 and "served in bfloat16, not FP8" in line
    assert f"{(talker_fp8 - 4 * talker_scales) / 2 ** 20:.1f} MiB more" in line, line
    assert load_thinker(fp8, with_audio=False).model.layers[0].self_attn.q_proj.weight.dtype == FP8_DTYPE


def test_fp8_everywhere_loads_the_talker_and_code_predictor_linears_as_fp8(checkpoints):
    _, fp8 = checkpoints
    talker = load_talker(fp8, fp8_everywhere=True)
    moe = talker.model.layers[0].mlp
    assert isinstance(moe.experts, Fp8Experts) and isinstance(moe.shared_expert.down_proj, Fp8Linear)
    assert moe.shared_expert_gate.weight.dtype == torch.float32 and moe.gate.weight.dtype == torch.float32
    predictor = talker.code_predictor.model.layers[0]
    assert isinstance(predictor.self_attn.o_proj, Fp8Linear) and isinstance(predictor.mlp.up_proj, Fp8Linear)
    assert talker.codec_head.weight.dtype == torch.float32
    assert talker.text_projection.linear_fc1.weight.dtype == torch.float32


def test_quantize_at_load_equals_quantizing_the_loaded_weights(checkpoints):
    source, _ = checkpoints
    plain = load_thinker(source, with_audio=False)
    quantized = load_thinker(source, with_audio=False, quantization="fp8")
    block = Fp8Scheme().block
    q_proj = quantized.model.layers[1].self_attn.q_proj
    assert q_proj.block == block == (128, 128)
    weight, scale_inv = quantize_fp8(plain.model.layers[1].self_attn.q_proj.weight, block)
    assert torch.equal(q_proj.weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(q_proj.weight_scale_inv, scale_inv)
    experts = quantized.model.layers[1].mlp.experts
    gate_up, down = experts.dequantized(torch.float32)
    full = plain.model.layers[1].mlp.experts
    assert torch.equal(down, dequantize_fp8(*quantize_fp8(full.down_proj, block), block))
    inter = full.gate_up_proj.shape[1] // 2
    assert torch.equal(gate_up[:, inter:], dequantize_fp8(*quantize_fp8(full.gate_up_proj[:, inter:], block), block))


def test_quantize_at_load_leaves_the_talker_as_it_is(checkpoints, caplog):
    source, _ = checkpoints
    for load_format in ("safetensors", "dummy"):
        plain = load_talker(source, load_format=load_format, seed=3)
        with caplog.at_level("WARNING", logger="omni_triton.models.weights"):
            served = load_talker(source, load_format=load_format, seed=3, quantization="fp8")
        assert all(torch.equal(tensor, served.state_dict()[name]) for name, tensor in plain.state_dict().items())
        assert served.state_dict().keys() == plain.state_dict().keys()
    assert any(r.getMessage().startswith("talker: served in float32, not FP8") for r in caplog.records)


def test_dummy_fp8_matches_dummy_bf16(checkpoints):
    source, _ = checkpoints
    plain = load_talker(source, load_format="dummy", seed=3)
    quantized = load_talker(source, load_format="dummy", seed=3, quantization="fp8", fp8_everywhere=True)
    layer, want = quantized.model.layers[0], plain.model.layers[0]
    assert torch.equal(layer.self_attn.k_proj.dequantized(torch.float32),
                       dequantize_fp8(*quantize_fp8(want.self_attn.k_proj.weight, (128, 128)), (128, 128)))
    gate_up, _ = layer.mlp.experts.dequantized(torch.float32)
    inter = gate_up.shape[1] // 2
    want_gate = dequantize_fp8(*quantize_fp8(want.mlp.experts.gate_up_proj[:, :inter], (128, 128)), (128, 128))
    assert torch.equal(gate_up[:, :inter], want_gate)
    assert torch.equal(layer.input_layernorm.weight, want.input_layernorm.weight)


def test_activation_dtype_skips_fp8_weights_and_their_scales(checkpoints):
    # an FP8 decoder layer's first parameters are float8 and its float32 scales: neither is what it computes in
    source, _ = checkpoints
    for load in (lambda q: load_thinker(source, dtype=torch.bfloat16, with_audio=False, quantization=q),
                 lambda q: load_talker(source, dtype=torch.bfloat16, quantization=q, fp8_everywhere=True)):
        plain, quantized = load(None), load("fp8")
        assert next(quantized.parameters()).dtype == FP8_DTYPE
        assert activation_dtype(quantized) == activation_dtype(plain) == torch.bfloat16


def test_the_engine_runs_an_fp8_thinker_in_its_activation_dtype(checkpoints):
    """What the engine's graph buffers and kept states are made in: bf16 for an FP8 model loaded in bf16 (the
    float32 block scales once made it float32, and the completion graphs then refused its bf16 states)."""
    from omni_triton.engine import EngineConfig, LLMEngine, ThinkerStage

    source, _ = checkpoints
    model = load_thinker(source, dtype=torch.bfloat16, with_audio=False, quantization="fp8")
    engine = LLMEngine(ThinkerStage(model), EngineConfig(block_size=4, num_blocks=16, kv_dtype=torch.bfloat16))
    assert engine.runner.model_dtype == torch.bfloat16


def test_unknown_quantization_is_named(checkpoints):
    source, _ = checkpoints
    with pytest.raises(ValueError, match="'int4'"):
        load_thinker(source, with_audio=False, quantization="int4")


@pytest.mark.parametrize("name, load", [
    ("thinker.model.layers.2.mlp.experts.5.down_proj.weight_scale_inv", lambda d: load_thinker(d, with_audio=False)),
    # the talker dequantizes at load (served in the model dtype): the same refusal
    ("talker.model.layers.1.mlp.experts.4.gate_proj.weight_scale_inv", load_talker),
    ("talker.code_predictor.model.layers.0.mlp.down_proj.weight_scale_inv", load_talker)])
def test_missing_scale_is_named(checkpoints, tmp_path, name, load):
    _, fp8 = checkpoints
    tensors = _tensors(fp8)
    del tensors[name]
    _rewrite(fp8, tmp_path, tensors)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(tmp_path)


def test_scale_without_its_fp8_weight_is_named(checkpoints, tmp_path):
    _, fp8 = checkpoints
    tensors = _tensors(fp8)
    name = "talker.model.layers.0.self_attn.o_proj.weight"
    tensors[name] = dequantize_fp8(tensors[name], tensors[name + "_scale_inv"], BLOCK)  # a plain weight, its scale left
    _rewrite(fp8, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv.*without its FP8 weight"):
        load_talker(tmp_path)


def test_unsupported_quantization_config_is_named(checkpoints, tmp_path):
    _, fp8 = checkpoints
    for path in fp8.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weight_block_size"):
        load_thinker(tmp_path, with_audio=False)


def test_quantized_copy_is_the_model_quantized_at_load(checkpoints):
    from omni_triton.models.layers.fp8 import quantized_copy

    source, _ = checkpoints
    plain = load_talker(source)
    before = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    copy = quantized_copy(plain)
    loaded = load_talker(source, quantization="fp8", fp8_everywhere=True)
    # the model copied is left as it was
    assert type(plain.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(torch.equal(before[name], tensor) for name, tensor in plain.state_dict().items())
    for name, tensor in loaded.state_dict().items():
        got = copy.state_dict()[name]
        assert got.dtype == tensor.dtype, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                           tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor), name


def test_accuracy_measures_agree_fully_with_the_model_itself_and_not_with_fp8(checkpoints):
    from omni_triton.bench.fp8_accuracy import PROMPTS, thinker_agreement
    from omni_triton.models.config import OmniConfig
    from omni_triton.models.layers.fp8 import quantized_copy
    from omni_triton.pipeline.chat import ChatTokenizer

    source, _ = checkpoints
    config, chat = OmniConfig.from_pretrained(source), ChatTokenizer.from_checkpoint(source)
    prompts = [chat.encode_prompt(text) for text in PROMPTS[:1]]
    thinker = load_thinker(source, with_audio=False)
    itself = thinker_agreement(thinker, thinker, config, prompts, 4)
    assert itself["teacher_forced_agreement"] == itself["free_running_agreement"] == 1.0
    assert abs(itself["mean_kl"]) < 1e-6 and itself["identical_continuations"] == 1.0
    fp8 = thinker_agreement(thinker, quantized_copy(thinker), config, prompts, 4)
    assert 0 < fp8["mean_kl"] and 0 <= fp8["teacher_forced_agreement"] <= 1
