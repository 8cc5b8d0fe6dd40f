"""Load the audio modules (Code2Wav vocoder, thinker audio encoder) from an HF-format checkpoint.

Tensors are read one at a time with safetensors' ``safe_open`` (sharded or single file) and copied into a
module built on the target device, so peak memory is the module plus one tensor. Loading is strict:
a missing, unexpected or mis-shaped tensor raises ValueError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omni_triton.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from omni_triton.models.code2wav import Code2Wav, Code2WavConfig

CODE2WAV_PREFIX = "code2wav."
AUDIO_ENCODER_PREFIX = "thinker.audio_tower."


def checkpoint_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint_dir / file for name, file in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    if not single.exists():
        raise ValueError(f"no model.safetensors(.index.json) in {checkpoint_dir}")
    with safe_open(single, "pt") as handle:
        return {name: single for name in handle.keys()}


def load_prefixed_(module: nn.Module, checkpoint_dir: str | Path, prefix: str) -> nn.Module:
    """Copy every checkpoint tensor named ``prefix + <state_dict key>`` into ``module`` (strict)."""
    checkpoint_dir = Path(checkpoint_dir)
    files = {name[len(prefix):]: path for name, path in checkpoint_files(checkpoint_dir).items()
             if name.startswith(prefix)}
    targets = module.state_dict()
    missing = sorted(set(targets) - set(files))
    unexpected = sorted(set(files) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{checkpoint_dir}: tensors under {prefix!r} do not match the module: "
                         f"missing {[prefix + n for n in missing]}, unexpected {[prefix + n for n in unexpected]}")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, "pt") as handle:
                for name in names:
                    tensor = handle.get_tensor(prefix + name)
                    target = targets[name]
                    if tensor.shape != target.shape:
                        raise ValueError(f"{prefix + name}: checkpoint shape {tuple(tensor.shape)} "
                                         f"!= module shape {tuple(target.shape)}")
                    target.copy_(tensor)
    return module


def load_code2wav(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Code2Wav:
    config = Code2WavConfig.from_pretrained(checkpoint_dir)
    with torch.device(device):
        model = Code2Wav(config).to(dtype)
    return load_prefixed_(model, checkpoint_dir, CODE2WAV_PREFIX).eval()


def load_audio_encoder(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> AudioEncoder:
    config = AudioEncoderConfig.from_pretrained(checkpoint_dir)
    with torch.device(device):
        model = AudioEncoder(config).to(dtype)
    return load_prefixed_(model, checkpoint_dir, AUDIO_ENCODER_PREFIX).eval()
