"""Rewrite a Qwen3-Omni checkpoint in the block-FP8 layout, quantized by transformers' own FP8 writer.

Each decoder-layer linear of the thinker, the talker and the code predictor (attention q/k/v/o, dense MLPs,
the shared expert, every routed expert) becomes float8_e4m3fn plus a float32 ``weight_scale_inv`` per block,
quantized by ``transformers``' ``Fp8Quantize`` (what its FineGrainedFP8 quantizer saves); config.json gets the
``quantization_config`` that loaders read (``quant_method: fp8``, ``weight_block_size``,
``modules_to_not_convert``). Everything else (embeddings, norms, routers, lm heads, the talker's projections,
the audio tower, vision, Code2Wav) is copied as it is. The tests' tiny FP8 checkpoints come from here, written
by code this package does not own, so that the loader is checked against the format and not against itself.

    python -m build_engines.fp8_checkpoint checkpoints/tiny checkpoints/tiny-fp8 --block 32
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

QUANTIZED = re.compile(r"^(thinker\.model|talker\.model|talker\.code_predictor\.model)\.layers\.\d+\."
                       r"(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)\.weight$")
NOT_CONVERTED = ["thinker.audio_tower", "thinker.visual", "code2wav", "lm_head", "codec_head", "embed_tokens",
                 "codec_embedding", "mlp.gate", "shared_expert_gate", "text_projection", "hidden_projection"]


def _quantizer(block: tuple[int, int]):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=NOT_CONVERTED)
    return Fp8Quantize(FineGrainedFP8HfQuantizer(config)), config


def write_fp8_checkpoint(source: str | Path, target: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """``source`` (a full-precision checkpoint dir) in the FP8 layout in ``target`` (one model.safetensors)."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    quantize, config = _quantizer(block)
    files = sorted(source.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if QUANTIZED.match(name):
                    converted = quantize.convert({name: tensor})
                    if converted[name].dtype != torch.float8_e4m3fn:
                        raise ValueError(f"{name!r} {tuple(tensor.shape)} does not tile into {block} blocks: "
                                         "transformers' writer leaves it unquantized")
                    tensors.update(converted)
                else:
                    tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy2(path, target / path.name)
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = {key: value for key, value in config.to_dict().items()
                                  if key in ("quant_method", "activation_scheme", "weight_block_size",
                                             "modules_to_not_convert")}
    raw["quantization_config"]["fmt"] = "e4m3"
    (target / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="full-precision checkpoint dir")
    parser.add_argument("target", type=Path, help="where the FP8 checkpoint goes")
    parser.add_argument("--block", type=int, default=128, help="square block size (default 128)")
    args = parser.parse_args(argv)
    print(write_fp8_checkpoint(args.source, args.target, (args.block, args.block)))


if __name__ == "__main__":
    main()
