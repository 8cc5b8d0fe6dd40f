"""Packed FP8 projections (``layers.fp8_packed``): q/k/v and gate/up of FP8 linears as one product where their
block scales stack, apart where they do not.

CPU: the packed weight and scales are the parts' stacked (bit for bit, dequantized too), the parts become views
(state dicts unchanged), widths that end inside a block stay apart; the packed product through the FP8 kernels
(Triton's interpreter: ``kernels_for`` patched to take CPU tensors) against the parts' products; and the tiny FP8
checkpoint (transformers' writer, 32 x 32 blocks: every q/k/v and gate/up width a multiple of 32) packed as
``set_fast_kernels`` packs on the GPU: its served output (the torch path on the CPU) the same bits as unpacked, its
kernel path as close to unpacked as the kernels' own rounding; quantized at load (128 x 128 blocks) only the
projections whose widths end on a block boundary pack. The GPU runs the same file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from omni_triton.models.layers.attention import contiguous_batch  # noqa: E402
from omni_triton.models.layers.fast_kernels import KernelSwitch  # noqa: E402
from omni_triton.models.layers.fp8 import Fp8Linear  # noqa: E402
from omni_triton.models.layers.fp8_packed import PackedFp8Linear, pack_fp8_linears_  # noqa: E402
from omni_triton.models.quantization import FP8_DTYPE, dequantize_fp8, quantize_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = (32, 32)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def fp8_linears(widths: list[int], depth: int, bias: bool = False, seed: int = 0) -> list[Fp8Linear]:
    gen = torch.Generator().manual_seed(seed)
    linears = []
    for width in widths:
        linear = Fp8Linear(depth, width, bias, BLOCK)
        weight, scale_inv = quantize_fp8(torch.randn(width, depth, generator=gen) / depth ** 0.5, BLOCK)
        with torch.no_grad():
            linear.weight.copy_(weight)
            linear.weight_scale_inv.copy_(scale_inv)
            if bias:
                linear.bias.copy_(torch.randn(width, generator=gen))
        linears.append(linear.to(DEVICE))
    return linears


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The layers' fast paths on CPU tensors too (Triton's interpreter runs their kernels)."""
    monkeypatch.setattr(KernelSwitch, "kernels_for", lambda self, x: self.use_kernels)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def snapshot(modules: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    return [{name: bits(t).clone() for name, t in module.state_dict().items()} for module in modules]


def same_state(before: list[dict], modules: list[torch.nn.Module]) -> bool:
    return all(list(b) == list(m.state_dict()) and all(torch.equal(b[n], bits(t)) for n, t in m.state_dict().items())
               for b, m in zip(before, modules))


# (widths, packs): q/k/v-like widths on 32-row blocks; the last part may end inside a block (its scales are the
# packed weight's last), a part before it may not
WIDTHS = [([64, 32, 32], True), ([64, 32, 20], True), ([48, 32, 32], False), ([32, 40, 32], False)]


@pytest.mark.parametrize("widths,packs", WIDTHS, ids=["-".join(map(str, w)) for w, _ in WIDTHS])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_and_scales_are_the_parts_stacked(widths, packs, bias):
    parts = fp8_linears(widths, depth=80, bias=bias)
    before = snapshot(parts)
    pointers = [part.weight.data_ptr() for part in parts]
    packed = pack_fp8_linears_(parts)
    assert same_state(before, parts)  # state dicts unchanged either way
    if not packs:
        assert packed is None and [part.weight.data_ptr() for part in parts] == pointers
        return
    assert packed.weight.shape == (sum(widths), 80) and packed.weight.dtype == FP8_DTYPE
    assert packed.weight_scale_inv.shape == (sum(-(-w // 32) for w in widths), 3)
    row = 0
    for part in parts:  # each part's parameters are views of the packed ones
        assert part.weight.data_ptr() == packed.weight[row].data_ptr()
        if bias:
            assert part.bias.data_ptr() == packed.bias[row:].data_ptr()
        row += part.out_features
    want = torch.cat([part.dequantized(torch.float32) for part in parts])
    assert torch.equal(dequantize_fp8(packed.weight, packed.weight_scale_inv, BLOCK), want)
    with torch.no_grad():  # a loader's copy_ into a part lands in the pack
        parts[1].weight_scale_inv.mul_(2)
    assert torch.equal(packed.weight_scale_inv[2:3], parts[1].weight_scale_inv)


def test_parts_of_other_blocks_or_without_fp8_stay_apart():
    wide = fp8_linears([64], depth=80)[0]
    other = Fp8Linear(80, 32, False, (16, 16)).to(DEVICE)
    plain = torch.nn.Linear(80, 32, bias=False).to(DEVICE)
    assert pack_fp8_linears_([wide, other]) is None
    assert pack_fp8_linears_([wide, plain]) is None
    assert pack_fp8_linears_([wide, fp8_linears([32], depth=80, bias=True)[0]]) is None  # a bias on one side only


@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_the_parts_products(rows, bias, kernels_on_cpu):
    """Through the FP8 kernels (and, switched off, the torch path): the packed output's columns are the parts'
    outputs."""
    parts = fp8_linears([64, 32, 32], depth=96, bias=bias, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    with torch.no_grad():
        apart = torch.cat([part(x) for part in parts], dim=-1)
        packed = pack_fp8_linears_(parts)
        got = packed(x)
        for part in parts:
            part.use_kernels = False
        reference = torch.cat([part(x) for part in parts], dim=-1)
        torch_packed = packed(x)
    assert got.shape == (rows, 128)
    assert rel_error(got, apart) < 1e-6 and rel_error(got, reference) < 1e-5
    assert rel_error(torch_packed, reference) < 1e-6


# ---------------------------------------------------------------------------------------------- the tiny model

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from build_engines.fp8_checkpoint import write_fp8_checkpoint
    from omni_triton.checkpoints.tiny import build

    return write_fp8_checkpoint(build(tmp_path_factory.mktemp("tiny"), "tiny"), tmp_path_factory.mktemp("fp8"),
                                BLOCK)


def pack_as_set_fast_kernels(model: torch.nn.Module) -> None:
    """What ``set_fast_kernels`` does on CUDA parameters, in its order (parents before children)."""
    for module in model.modules():
        if isinstance(module, KernelSwitch):
            module.pack_projections_()


def packs(model: torch.nn.Module) -> list:
    """Every attention's packed q/k/v and every dense MLP's packed gate/up (None where not packed)."""
    from omni_triton.models.layers.decoder import SelfAttention
    from omni_triton.models.layers.mlp import GatedMLP

    return ([m.packed_qkv for m in model.modules() if isinstance(m, SelfAttention)]
            + [m.packed_gate_up for m in model.modules() if isinstance(m, GatedMLP)])


def prefill(model, embeds: torch.Tensor) -> torch.Tensor:
    batch = contiguous_batch([embeds.shape[0]], model.num_layers, model.num_kv_heads, model.head_dim,
                             dtype=embeds.dtype, device=embeds.device)
    batch.use_kernels = False  # the same attention both ways: the linears are what differs
    positions = torch.arange(embeds.shape[0], device=embeds.device)[None].expand(3, -1)
    with torch.no_grad():
        return model.model(embeds, positions, batch)[0]


def test_tiny_fp8_checkpoint_packs_and_serves_the_same_output(fp8_checkpoint, kernels_on_cpu):
    from omni_triton.models.weights import load_talker, load_thinker

    # the talker FP8 too (``fp8_everywhere``: served, it is dequantized at load)
    for load in (lambda: load_thinker(fp8_checkpoint, DEVICE, with_audio=False),
                 lambda: load_talker(fp8_checkpoint, DEVICE, fp8_everywhere=True)):
        model, apart = load(), load()
        embeds = torch.randn(5, model.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        before = snapshot([model])
        for module in model.modules():  # the served path on the CPU: torch
            if isinstance(module, KernelSwitch):
                module.use_kernels = False
        served_apart = prefill(model, embeds)
        pack_as_set_fast_kernels(model)
        assert same_state(before, [model])
        assert packs(model) and all(isinstance(p, PackedFp8Linear) for p in packs(model))
        assert torch.equal(prefill(model, embeds), served_apart)
        for module in model.modules():  # the kernels, packed and apart (never packed)
            if isinstance(module, KernelSwitch):
                module.use_kernels = True
        kernels_packed, kernels_apart = prefill(model, embeds), prefill(apart, embeds)
        assert all(p is None for p in packs(apart))
        # fp32: the launches' own summation orders (a misplaced block scale would be off by percents)
        assert rel_error(kernels_packed, kernels_apart) < 1e-5
        assert rel_error(kernels_packed, served_apart) < 1e-4


def test_quantized_at_load_packs_only_where_a_width_ends_on_a_block(fp8_checkpoint):
    """128 x 128 blocks: the tiny model's q (64 wide) and the talker's shared-expert gate (64) end inside a block,
    so their projections stay apart; the code predictor's gate (128) is one whole block, so its gate/up pack."""
    from omni_triton.checkpoints.tiny import build
    from omni_triton.models.layers.decoder import SelfAttention
    from omni_triton.models.layers.mlp import GatedMLP
    from omni_triton.models.weights import load_talker

    talker = load_talker(build(fp8_checkpoint.parent / "plain", "tiny"), DEVICE, quantization="fp8",
                         fp8_everywhere=True)
    pack_as_set_fast_kernels(talker)
    attentions = [m for m in talker.modules() if isinstance(m, SelfAttention)]
    assert attentions and all(m.packed_qkv is None for m in attentions)
    mlps = {name: m for name, m in talker.named_modules() if isinstance(m, GatedMLP)}
    for name, mlp in mlps.items():
        whole_blocks = mlp.gate_proj.out_features % 128 == 0
        assert isinstance(mlp.packed_gate_up, PackedFp8Linear) == whole_blocks, name
    assert any(name.startswith("code_predictor") and isinstance(m.packed_gate_up, PackedFp8Linear)
               for name, m in mlps.items())
    assert any(name.endswith("shared_expert") and m.packed_gate_up is None for name, m in mlps.items())
