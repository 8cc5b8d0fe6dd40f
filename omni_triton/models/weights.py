"""Streaming, strict loaders for the thinker and talker from an HF-format Qwen3-Omni checkpoint.

The module is built on the meta device, materialised empty on the target device/dtype, then filled tensor
by tensor from ``safe_open`` (single ``model.safetensors`` or shards listed in
``model.safetensors.index.json``), so peak memory is the model plus one tensor. Per-expert checkpoint
tensors (``...mlp.experts.E.{gate,up,down}_proj.weight``) land in the stacked ``experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``. Strict: a missing,
unexpected (inside the component's prefix) or mis-shaped tensor raises ValueError naming it. Other
components' tensors are ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omni_triton.models.config import OmniConfig
from omni_triton.models.talker import Talker
from omni_triton.models.thinker import Thinker

THINKER_PREFIX = "thinker."
TALKER_PREFIX = "talker."
# Thinker sub-trees this package does not load (vision is not served; audio has its own loader).
THINKER_SKIPPED = ("thinker.visual.", "thinker.audio_tower.")

_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint_dir / file for name, file in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {str(checkpoint_dir)!r}")
    with safe_open(single, "pt") as handle:
        return {name: single for name in handle.keys()}


def _materialise(build, device, dtype) -> nn.Module:
    with torch.device("meta"):
        module = build()
    return module.to(dtype).to_empty(device=device).eval()


def load_component_(module: nn.Module, checkpoint_dir: str | Path, prefix: str,
                    skip_prefixes: tuple[str, ...] = ()) -> nn.Module:
    """Fill ``module`` from every checkpoint tensor under ``prefix`` (strict), streaming one at a time."""
    targets = dict(module.state_dict())
    files = {name: path for name, path in checkpoint_index(checkpoint_dir).items()
             if name.startswith(prefix) and not name.startswith(skip_prefixes)}
    pending: dict[str, set] = {}  # target name -> parts still to fill (stacked experts fill in pieces)
    for name in targets:
        if name.endswith(".experts.gate_up_proj"):
            pending[name] = {(e, part) for e in range(targets[name].shape[0]) for part in ("gate_proj", "up_proj")}
        elif name.endswith(".experts.down_proj"):
            pending[name] = {(e, "down_proj") for e in range(targets[name].shape[0])}
        else:
            pending[name] = {None}

    by_file: dict[Path, list[str]] = {}
    for name, path in sorted(files.items()):
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, "pt") as handle:
                for name in names:
                    target_name, view, part = _destination(name[len(prefix):], targets)
                    if target_name is None or part not in pending.get(target_name, ()):
                        raise ValueError(f"unexpected tensor {name!r} in {str(path)!r}: no matching parameter "
                                         f"under {prefix!r} (or it appears twice)")
                    tensor = handle.get_tensor(name)
                    if tensor.shape != view.shape:
                        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(view.shape)}")
                    view.copy_(tensor)
                    pending[target_name].discard(part)
    missing = [_checkpoint_name(prefix, target, part) for target, parts in pending.items() for part in sorted(
        parts, key=str)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        raise ValueError(f"{len(missing)} tensor(s) missing from {str(checkpoint_dir)!r}: {shown}"
                         + (" ..." if len(missing) > 8 else ""))
    return module


def _destination(name: str, targets: dict[str, torch.Tensor]):
    """Checkpoint name (prefix stripped) -> (target state-dict name, tensor view to fill, part key)."""
    match = _EXPERT.match(name)
    if match is None:
        return (name, targets[name], None) if name in targets else (None, None, None)
    experts, expert, proj = match["experts"], int(match["expert"]), match["proj"]
    if proj == "down_proj":
        target_name = experts + ".down_proj"
        if target_name not in targets or expert >= targets[target_name].shape[0]:
            return None, None, None
        return target_name, targets[target_name][expert], (expert, proj)
    target_name = experts + ".gate_up_proj"
    if target_name not in targets or expert >= targets[target_name].shape[0]:
        return None, None, None
    stacked = targets[target_name][expert]
    half = stacked.shape[0] // 2
    return target_name, stacked[:half] if proj == "gate_proj" else stacked[half:], (expert, proj)


def _checkpoint_name(prefix: str, target: str, part) -> str:
    if part is None:
        return prefix + target
    expert, proj = part
    return f"{prefix}{target.rsplit('.', 1)[0]}.{expert}.{proj}.weight"


def load_thinker(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, with_audio: bool = True) -> Thinker:
    config = OmniConfig.from_pretrained(checkpoint_dir)
    thinker = _materialise(lambda: Thinker(config.thinker), device, dtype)
    load_component_(thinker, checkpoint_dir, THINKER_PREFIX, THINKER_SKIPPED)
    if with_audio:
        from omni_triton.models.audio_weights import load_audio_encoder  # the audio helper's module

        thinker.audio_encoder = load_audio_encoder(checkpoint_dir, device, dtype)
    return thinker


def load_talker(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Talker:
    config = OmniConfig.from_pretrained(checkpoint_dir)
    talker = _materialise(lambda: Talker(config.talker), device, dtype)
    return load_component_(talker, checkpoint_dir, TALKER_PREFIX)


def load_code2wav(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32):
    from omni_triton.models.audio_weights import load_code2wav as load  # the audio helper's module

    return load(checkpoint_dir, device, dtype)


def load_thinker_embedding_rows(checkpoint_dir: str | Path, token_ids: list[int],
                                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Thinker input embeddings of a few tokens ([N, H]) without loading the thinker: the talker stage
    needs those of tts_bos/tts_eos/tts_pad to build its inputs."""
    name = THINKER_PREFIX + "model.embed_tokens.weight"
    files = checkpoint_index(checkpoint_dir)
    if name not in files:
        raise ValueError(f"tensor {name!r} missing from {str(checkpoint_dir)!r}")
    with safe_open(files[name], "pt") as handle:
        table = handle.get_slice(name)
        vocab = table.get_shape()[0]
        for token in token_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} outside the thinker vocab of {vocab}")
        rows = torch.stack([table[token:token + 1][0] for token in token_ids])
    return rows.to(device=device, dtype=dtype)
