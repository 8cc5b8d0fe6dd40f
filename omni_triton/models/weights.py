"""Streaming, strict loaders for the thinker, talker, vocoder and audio encoder from an HF-format Qwen3-Omni checkpoint.

The module is built on the meta device, materialised empty on the target device/dtype, then filled tensor
by tensor from ``safe_open`` (single ``model.safetensors`` or shards listed in
``model.safetensors.index.json``), so peak memory is the model plus one tensor. Per-expert checkpoint
tensors (``...mlp.experts.E.{gate,up,down}_proj.weight``) land in the stacked ``experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``. Strict: a missing,
unexpected (inside the component's prefix) or mis-shaped tensor raises ValueError naming it. Other
components' tensors are ignored.

Block-FP8 (``models.quantization``): a checkpoint whose config.json has an FP8 ``quantization_config`` is
served as it is, every module with a ``weight_scale_inv`` built as its FP8 twin (``layers.fp8``) and filled
with the FP8 weight and its scales; ``quantization="fp8"`` quantizes a full-precision checkpoint (or the dummy
weights, the same values as the unquantized dummy model's) at load, tensor by tensor, in the same layout. Only the
components ``quantization.served_in_fp8`` names (the thinker) are built FP8; the talker is built in the model dtype,
an FP8 checkpoint's talker tensors dequantized as they are read (``fp8_everywhere=True``: FP8 wherever the checkpoint
or ``quantization`` says, to measure what that policy avoids), with a log line naming the memory it costs.

``load_format="dummy"`` reads only config.json (a checkpoint dir or a shipped config name such as
``qwen3_omni_30b_a3b``) and fills every parameter with seeded random values generated on the target device:
the full-size model on one GPU with no checkpoint on disk. Each tensor's values depend only on the seed and
its name, so a component loaded alone (the thinker's embedding rows the talker stage needs) matches the
same component loaded whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omni_triton.models.config import OmniConfig, resolve_config_dir
from omni_triton.models.layers.fp8 import Fp8Experts, is_fp8, quantize_modules_, store_quantized_
from omni_triton.models.layers.moe import Experts
from omni_triton.models.quantization import FP8_DTYPE, SCALE_SUFFIX, Fp8Scheme, check_quantization, \
    checkpoint_scheme, dequantize_fp8, quantized_at_load, scale_shape, served_in_fp8
from omni_triton.models.talker import Talker
from omni_triton.models.thinker import Thinker

THINKER_PREFIX = "thinker."
TALKER_PREFIX = "talker."
CODE2WAV_PREFIX = "code2wav."
AUDIO_ENCODER_PREFIX = "thinker.audio_tower."
# Thinker sub-trees this package does not load (vision is not served; audio has its own loader).
THINKER_SKIPPED = ("thinker.visual.", "thinker.audio_tower.")
LOAD_FORMATS = ("safetensors", "dummy")

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.weight(?P<scale>_scale_inv)?$")


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


def _materialise(build, device, dtype, fp8: tuple[Fp8Scheme, object] | None = None) -> nn.Module:
    """Built on the meta device in ``dtype``; ``fp8`` (scheme, selected): those modules swapped for their FP8
    twins after the cast (which would otherwise turn FP8 weights into ``dtype``)."""
    with torch.device("meta"):
        module = build().to(dtype)
        if fp8 is not None:
            quantize_modules_(module, *fp8)
    return module.to_empty(device=device).eval()


def _fp8_plan(checkpoint_dir: str | Path, prefix: str, quantization: str | None,
              load_format: str) -> tuple[Fp8Scheme, object] | None:
    """(scheme, selected(name, module)) of the modules FP8 weights would cover, or None. An FP8 checkpoint picks its
    own (every module it has a ``weight_scale_inv`` for); quantizing at load (or random weights from an FP8
    checkpoint's config), ``quantization.quantized_at_load``'s rule."""
    check_quantization(quantization)
    dummy = load_format == "dummy"
    own = checkpoint_scheme(resolve_config_dir(checkpoint_dir) if dummy else checkpoint_dir)
    if own is not None and not dummy:
        names = {_module_of(name[len(prefix):]) for name in checkpoint_index(checkpoint_dir)
                 if name.startswith(prefix) and name.endswith(".weight" + SCALE_SUFFIX)}
        return own, lambda name, module: name in names
    if own is not None or quantization == "fp8":
        return own or Fp8Scheme(), quantized_at_load
    return None


def _served_plan(checkpoint_dir: str | Path, prefix: str, quantization: str | None, load_format: str,
                 fp8_everywhere: bool) -> tuple[tuple[Fp8Scheme, object] | None, tuple[Fp8Scheme, object] | None]:
    """(the FP8 modules to build, the FP8 plan this component declines): by ``quantization.served_in_fp8``, unless
    ``fp8_everywhere``. At most one of the two is set."""
    plan = _fp8_plan(checkpoint_dir, prefix, quantization, load_format)
    if plan is None or fp8_everywhere or served_in_fp8(prefix.rstrip(".")):
        return plan, None
    return None, plan


def _log_declined_fp8(module: nn.Module, component: str, declined: tuple[Fp8Scheme, object]) -> None:
    """The log line of a component served in the model dtype where FP8 was asked for (or the checkpoint is FP8),
    with the bytes that costs: each declined weight's (element size - 1) bytes less its fp32 block scales."""
    (scheme, selected), dtype = declined, next(module.parameters()).dtype
    extra = 0
    for name, owner in module.named_modules():
        if not (name and selected(name, owner)):
            continue
        if isinstance(owner, Experts):  # stacked [E, rows, cols]; gate and up rows blocked apart (Fp8Experts)
            weights = [(owner.gate_up_proj, 2), (owner.down_proj, 1)]
        else:
            weights = [(owner.weight, 1)]
        for weight, halves in weights:
            rows, cols = weight.shape[-2:]
            scales = weight[..., 0, 0].numel() * halves * math.prod(scale_shape(rows // halves, cols, scheme.block))
            extra += weight.numel() * (weight.element_size() - 1) - scales * 4
    logger.warning("%s: served in %s, not FP8 (quantization.FP8_SERVED_COMPONENTS: its steps are launch-bound and "
                   "its weights small): %.1f MiB more than its FP8 weights would take", component,
                   str(dtype).removeprefix("torch."), extra / 2 ** 20)


def _module_of(scale_name: str) -> str:
    """``a.q_proj.weight_scale_inv`` -> ``a.q_proj``; a per-expert scale -> the layer's stacked ``...experts``."""
    match = _EXPERT.match(scale_name)
    return match["experts"] if match else scale_name[:-len(".weight" + SCALE_SUFFIX)]


def load_component_(module: nn.Module, checkpoint_dir: str | Path, prefix: str,
                    skip_prefixes: tuple[str, ...] = (), dequantize: Fp8Scheme | None = None) -> nn.Module:
    """Fill ``module`` from every checkpoint tensor under ``prefix`` (strict), streaming one at a time.
    ``dequantize``: the FP8 checkpoint's scheme, for a module built in the model dtype: each FP8 weight is
    dequantized with its ``weight_scale_inv`` (read with it) into its full-precision parameter."""
    targets = dict(module.state_dict())
    files = {name: path for name, path in checkpoint_index(checkpoint_dir).items()
             if name.startswith(prefix) and not name.startswith(skip_prefixes)}
    # scales read with their weights, not on their own; any left at the end had no weight
    scales = {name: files.pop(name) for name in list(files)
              if dequantize is not None and name.endswith(".weight" + SCALE_SUFFIX)}
    pending: dict[str, set] = {}  # target name -> parts still to fill (stacked experts fill in pieces)
    for name in targets:
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj" + SCALE_SUFFIX)):
            pending[name] = {(e, part) for e in range(targets[name].shape[0]) for part in ("gate_proj", "up_proj")}
        elif name.endswith((".experts.down_proj", ".experts.down_proj" + SCALE_SUFFIX)):
            pending[name] = {(e, "down_proj") for e in range(targets[name].shape[0])}
        else:
            pending[name] = {None}

    by_file: dict[Path, list[str]] = {}
    for name, path in sorted(files.items()):
        by_file.setdefault(path, []).append(name)
    with torch.no_grad(), contextlib.ExitStack() as opened:
        handles: dict[Path, object] = {}  # the scales' files, each opened once

        def handle_of(path: Path):
            if path not in handles:
                handles[path] = opened.enter_context(safe_open(path, "pt"))
            return handles[path]

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
                    if tensor.dtype == FP8_DTYPE and view.dtype != FP8_DTYPE and dequantize is not None:
                        tensor = _dequantized(name, tensor, scales, handle_of, dequantize.block, view.dtype)
                    if tensor.dtype == FP8_DTYPE and view.dtype != FP8_DTYPE:
                        raise ValueError(f"tensor {name!r} is {tensor.dtype} but the model's is {view.dtype}: "
                                         "an FP8 weight needs its weight_scale_inv and a quantization_config")
                    if view.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:  # quantized at load
                        scale_target, scale_view, scale_part = _destination(name[len(prefix):] + SCALE_SUFFIX, targets)
                        store_quantized_(view, scale_view, tensor, _fp8_block(module, target_name))
                        pending[scale_target].discard(scale_part)
                    else:
                        view.copy_(tensor)
                    pending[target_name].discard(part)
    if scales:
        name = min(scales)
        raise ValueError(f"unexpected tensor {name!r} in {str(scales[name])!r}: a block scale without its FP8 weight")
    missing = [_checkpoint_name(prefix, target, part) for target, parts in pending.items() for part in sorted(
        parts, key=str)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        raise ValueError(f"{len(missing)} tensor(s) missing from {str(checkpoint_dir)!r}: {shown}"
                         + (" ..." if len(missing) > 8 else ""))
    return module


def _dequantized(name: str, weight: torch.Tensor, scales: dict[str, Path], handle_of, block: tuple[int, int],
                 dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint's FP8 ``weight`` (tensor ``name``) times its block scales (taken out of ``scales``, read
    through ``handle_of(file)``)."""
    scale_name = name + SCALE_SUFFIX
    if scale_name not in scales:
        raise ValueError(f"tensor {name!r} is FP8 but {scale_name!r} is missing: an FP8 weight needs its block scales")
    scale_inv = handle_of(scales.pop(scale_name)).get_tensor(scale_name)
    if scale_inv.shape != scale_shape(*weight.shape, block):
        raise ValueError(f"tensor {scale_name!r} has shape {tuple(scale_inv.shape)}, expected "
                         f"{scale_shape(*weight.shape, block)} for {block[0]} x {block[1]} blocks")
    return dequantize_fp8(weight, scale_inv, block, dtype)


def _fp8_block(module: nn.Module, target_name: str) -> tuple[int, int]:
    return module.get_submodule(target_name.rsplit(".", 1)[0]).block


def _destination(name: str, targets: dict[str, torch.Tensor]):
    """Checkpoint name (prefix stripped) -> (target state-dict name, tensor view to fill, part key)."""
    match = _EXPERT.match(name)
    if match is None:
        return (name, targets[name], None) if name in targets else (None, None, None)
    experts, expert, proj = match["experts"], int(match["expert"]), match["proj"]
    suffix = match["scale"] or ""
    if proj == "down_proj":
        target_name = experts + ".down_proj" + suffix
        if target_name not in targets or expert >= targets[target_name].shape[0]:
            return None, None, None
        return target_name, targets[target_name][expert], (expert, proj)
    target_name = experts + ".gate_up_proj" + suffix
    if target_name not in targets or expert >= targets[target_name].shape[0]:
        return None, None, None
    stacked = targets[target_name][expert]
    half = stacked.shape[0] // 2
    return target_name, stacked[:half] if proj == "gate_proj" else stacked[half:], (expert, proj)


def _checkpoint_name(prefix: str, target: str, part) -> str:
    if part is None:
        return prefix + target
    expert, proj = part
    suffix = SCALE_SUFFIX if target.endswith(SCALE_SUFFIX) else ""
    return f"{prefix}{target.rsplit('.', 1)[0]}.{expert}.{proj}.weight{suffix}"


def _check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")


def _dummy_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def _dummy_values_(name: str, tensor: torch.Tensor, seed: int) -> None:
    """Well-scaled random values: fan-in scaled matrices keep activations O(1) through every stage (so greedy
    decoding gives varied tokens and routing spreads over the experts), norms near 1, SnakeBeta's log-scale
    parameters and layer scales small."""
    generator = torch.Generator(device=tensor.device).manual_seed(_dummy_seed(seed, name))
    leaf = name.rsplit(".", 2)
    if name.endswith("weight") and len(leaf) > 1 and "norm" in leaf[-2]:
        tensor.normal_(1.0, 0.1, generator=generator)
    elif name.endswith(("alpha", "beta")):
        tensor.normal_(0.0, 0.1, generator=generator)
    elif "layer_scale" in name or name.endswith(".scale"):
        tensor.normal_(0.1, 0.02, generator=generator)
    elif tensor.dim() >= 2:
        fan_in = tensor.shape[-1] if (tensor.dim() == 3 and "experts" in name) else tensor[0].numel()
        damping = 0.1 if name.startswith("decoder.") and ".conv2." in name else 1.0  # Code2Wav residual units
        tensor.normal_(0.0, damping / math.sqrt(max(fan_in, 1)), generator=generator)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)


def init_dummy_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every floating-point parameter of ``module`` in place (see ``_dummy_values_``). An FP8 weight gets
    the values the unquantized model's would have (drawn in the model dtype), quantized, and its scales."""
    dtypes = {param.dtype for param in module.parameters() if param.is_floating_point()} - {FP8_DTYPE, torch.float32}
    model_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with torch.no_grad():
        for name, param in module.named_parameters():
            owner = module.get_submodule(name.rpartition(".")[0])
            if is_fp8(owner) and name.endswith(SCALE_SUFFIX):
                continue  # filled with its weight
            if param.dtype == FP8_DTYPE:
                full = torch.empty(param.shape, dtype=model_dtype, device=param.device)
                _dummy_values_(name, full, seed)
                halves = 2 if isinstance(owner, Fp8Experts) and name.endswith("gate_up_proj") else 1
                store_quantized_(param, module.get_parameter(name + SCALE_SUFFIX), full, owner.block, halves)
            elif param.is_floating_point():
                _dummy_values_(name, param, seed)
    return module


def load_thinker(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, with_audio: bool = True, *, load_format: str = "safetensors",
                 seed: int = 0, quantization: str | None = None, fp8_everywhere: bool = False) -> Thinker:
    """``quantization`` "fp8": block-FP8 weights quantized at load (an FP8 checkpoint is FP8 without it), where
    ``quantization.served_in_fp8`` (or ``fp8_everywhere``) says."""
    _check_load_format(load_format)
    config = OmniConfig.from_pretrained(resolve_config_dir(checkpoint_dir) if load_format == "dummy"
                                        else checkpoint_dir)
    fp8, declined = _served_plan(checkpoint_dir, THINKER_PREFIX, quantization, load_format, fp8_everywhere)
    thinker = _materialise(lambda: Thinker(config.thinker), device, dtype, fp8)
    if load_format == "dummy":
        init_dummy_(thinker, seed)
    else:
        load_component_(thinker, checkpoint_dir, THINKER_PREFIX, THINKER_SKIPPED,
                        dequantize=None if declined is None else declined[0])
    if declined is not None:
        _log_declined_fp8(thinker, "thinker", declined)
    if with_audio:
        if load_format == "dummy":
            from omni_triton.models.audio_encoder import AudioEncoder

            with torch.device(device):
                thinker.audio_encoder = init_dummy_(AudioEncoder(config.thinker.audio).to(dtype), seed).eval()
        else:
            thinker.audio_encoder = load_audio_encoder(checkpoint_dir, device, dtype)
    return thinker


def load_talker(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, *, load_format: str = "safetensors", seed: int = 0,
                quantization: str | None = None, fp8_everywhere: bool = False) -> Talker:
    """``quantization`` and ``fp8_everywhere`` as ``load_thinker``'s: the talker stays in ``dtype`` unless
    ``fp8_everywhere`` (``quantization.served_in_fp8``)."""
    _check_load_format(load_format)
    fp8, declined = _served_plan(checkpoint_dir, TALKER_PREFIX, quantization, load_format, fp8_everywhere)
    config = OmniConfig.from_pretrained(resolve_config_dir(checkpoint_dir) if load_format == "dummy"
                                        else checkpoint_dir)
    talker = _materialise(lambda: Talker(config.talker), device, dtype, fp8)
    if load_format == "dummy":
        init_dummy_(talker, seed)
    else:
        load_component_(talker, checkpoint_dir, TALKER_PREFIX, dequantize=None if declined is None else declined[0])
    if declined is not None:
        _log_declined_fp8(talker, "talker", declined)
    return talker


def load_code2wav(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, *, load_format: str = "safetensors", seed: int = 0):
    _check_load_format(load_format)
    from omni_triton.models.code2wav.vocoder import Code2Wav, Code2WavConfig

    # built on the device (not on "meta"): its non-persistent buffers are computed in __init__
    if load_format == "dummy":
        config = OmniConfig.from_pretrained(resolve_config_dir(checkpoint_dir))
        with torch.device(device):
            return init_dummy_(Code2Wav(config.code2wav).to(dtype), seed).eval()
    with torch.device(device):
        model = Code2Wav(Code2WavConfig.from_pretrained(checkpoint_dir)).to(dtype)
    return load_component_(model, checkpoint_dir, CODE2WAV_PREFIX).eval()


def load_audio_encoder(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32):
    """The thinker's audio encoder from an HF-format checkpoint (built on the device, as the vocoder)."""
    from omni_triton.models.audio_encoder import AudioEncoder, AudioEncoderConfig

    with torch.device(device):
        model = AudioEncoder(AudioEncoderConfig.from_pretrained(checkpoint_dir)).to(dtype)
    return load_component_(model, checkpoint_dir, AUDIO_ENCODER_PREFIX).eval()


def load_thinker_embedding_rows(checkpoint_dir: str | Path, token_ids: list[int],
                                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
                                load_format: str = "safetensors", seed: int = 0) -> torch.Tensor:
    """Thinker input embeddings of a few tokens ([N, H]) without loading the thinker: the talker stage
    needs those of tts_bos/tts_eos/tts_pad to build its inputs."""
    _check_load_format(load_format)
    if load_format == "dummy":
        text = OmniConfig.from_pretrained(resolve_config_dir(checkpoint_dir)).thinker.text
        for token in token_ids:
            if not 0 <= token < text.vocab_size:
                raise ValueError(f"token id {token} outside the thinker vocab of {text.vocab_size}")
        table = torch.empty(text.vocab_size, text.hidden_size, dtype=dtype, device=device)
        _dummy_values_("model.embed_tokens.weight", table, seed)
        return table[token_ids].clone()
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
