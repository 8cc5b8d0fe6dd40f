"""Block-FP8 weights: the checkpoint format, its math, and which modules it covers.

The format is the DeepSeek-V3 / Qwen3 FP8 layout that Hugging Face checkpoints ship: config.json has
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}``, and each quantized linear's ``weight`` is
float8_e4m3fn beside a float32 ``weight_scale_inv`` of one value per ``block_out x block_in`` block
(``[ceil(out / block_out), ceil(in / block_in)]``; the last blocks may be partial). Dequantized, a weight is
``weight * weight_scale_inv`` of its block.

Which modules are FP8: a checkpoint decides for itself (every linear that has a ``weight_scale_inv``);
quantizing at load (``--quantization fp8`` of a bf16 checkpoint or of random weights) takes the decoder layers'
linears of the thinker, the talker and the code predictor (attention q/k/v/o, dense MLPs, the talker's shared
expert) and the routed experts: the weights a decode step reads. Embeddings, norms, the MoE routers and the
shared-expert gate (1 row), the lm heads, the talker's text/hidden projections, the audio encoder and Code2Wav
stay in the model dtype, as in the community Qwen3-Omni FP8 checkpoint (audio tower, vision, Code2Wav,
embeddings, norms and MoE gates in bf16): routers and lm heads pick tokens and experts from small logit gaps,
and they and the projections are a few percent of a step's bytes.

Which components are served in FP8 (``served_in_fp8``, decided here and nowhere else): the thinker. The talker and
its code predictor are served in the model dtype under ``--quantization fp8`` and from an FP8 checkpoint (its FP8
tensors dequantized once at load), because FP8 made them slower and saves little there: their ~6 GiB of bf16
weights (~9% of the model) would save ~2.9 GiB, while their steps are bound by launches and latency, not bytes
(a frame is one talker step and 15 code-predictor steps at a few rows), and the bf16 path's fusions read bf16
weights only. FP8 took the code predictor off its fused frame (~28 launches a step) onto its modules (~65), and
split the talker MoE's packed input projection (shared gate/up, router, shared-expert gate: one launch, the
shared expert on a side stream, its gated sum inside the top-k sum) into separate launches plus a sigmoid, a
product and a sum per layer; its prefill's products ran on the tiled FP8 kernel instead of cuBLAS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

QUANTIZATIONS = ("fp8",)
# the components (loader prefixes without the dot) whose FP8 weights are served as FP8; the others in the model dtype
# (see the module docstring)
FP8_SERVED_COMPONENTS = ("thinker",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # ``weight`` -> ``weight_scale_inv``, ``gate_up_proj`` -> ``gate_up_proj_scale_inv``

# Linears of a decoder layer that quantizing at load converts (relative to ``...layers.N.``); routers
# (``mlp.gate``) and ``mlp.shared_expert_gate`` stay in the model dtype
_QUANTIZED_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj)$")
_QUANTIZED_EXPERTS = re.compile(r"(^|\.)layers\.\d+\.mlp\.experts$")


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)} "
                         "(or none for the checkpoint's own weights)")


@dataclass(frozen=True)
class Fp8Scheme:
    """Block-FP8 weights: ``block`` = (rows, columns) of a weight that share one scale."""

    block: tuple[int, int] = DEFAULT_BLOCK

    @classmethod
    def from_quantization_config(cls, cfg: dict, where: str) -> "Fp8Scheme":
        method = cfg.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported (only 'fp8')")
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
        activations = cfg.get("activation_scheme", "dynamic")
        if activations != "dynamic":
            raise ValueError(f"{where}: quantization_config.activation_scheme {activations!r} is not supported (only "
                             "'dynamic': static activation scales are not read)")
        block = cfg.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size {block!r} is not [rows, columns] "
                             "(per-tensor FP8 is not supported)")
        return cls(block=(int(block[0]), int(block[1])))


def checkpoint_scheme(config_dir: str | Path) -> Fp8Scheme | None:
    """The checkpoint's own quantization (config.json's ``quantization_config``), None for plain weights."""
    path = Path(config_dir) / "config.json"
    cfg = json.loads(path.read_text()).get("quantization_config")
    return None if cfg is None else Fp8Scheme.from_quantization_config(cfg, str(path))


def served_in_fp8(component: str) -> bool:
    """Whether ``component`` ("thinker", "talker") keeps FP8 weights FP8 (``FP8_SERVED_COMPONENTS``)."""
    return component in FP8_SERVED_COMPONENTS


def quantized_at_load(module_name: str, module: torch.nn.Module) -> bool:
    """Whether quantizing at load converts this module (see the module docstring)."""
    if _QUANTIZED_EXPERTS.search(module_name):
        # the stacked experts (``layers.moe.Experts``), known by their stacked weight: the layers import this
        # module (``layers.fp8_packed``), so importing theirs here would close a circle
        return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    return isinstance(module, torch.nn.Linear) and bool(_QUANTIZED_LINEAR.search(module_name))


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (float8_e4m3fn weight, float32 scale_inv [..., ceil(out/b0), ceil(in/b1)]):
    each block scaled so that its largest magnitude is FP8's largest (an all-zero block gets scale 1)."""
    rows, cols = weight.shape[-2:]
    blocks = _blocked(weight.float(), block)  # [..., R, b0, C, b1] zero-padded
    amax = blocks.abs().amax(dim=(-3, -1))
    # multiply by FP8_MAX / amax and store its reciprocal, as transformers' FP8 writer does: the same bits
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    scale_inv = 1.0 / scale
    quantized = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = quantized.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].to(FP8_DTYPE)
    return quantized.contiguous(), scale_inv.contiguous()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantization: ``weight * scale_inv`` of its block in fp32, rounded once to ``dtype``."""
    rows, cols = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scales = scales.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scales).to(dtype)


def _blocked(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight.shape[-2:]
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    padded = torch.nn.functional.pad(weight, (0, pad_cols, 0, pad_rows))
    lead = weight.shape[:-2]
    return padded.reshape(*lead, (rows + pad_rows) // block[0], block[0], (cols + pad_cols) // block[1], block[1])
