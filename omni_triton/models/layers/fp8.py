"""Block-FP8 twins of ``nn.Linear`` and of the stacked MoE experts (``models.quantization`` has the format).

The weights stay float8_e4m3fn in memory beside their float32 block scales (state-dict names as the
checkpoint's: ``weight`` + ``weight_scale_inv``; the experts' ``gate_up_proj`` + ``gate_up_proj_scale_inv`` and
``down_proj`` + ``down_proj_scale_inv``). The torch path dequantizes the weight to the activations' dtype on
every call (``quantization.dequantize_fp8``): the CPU path and the reference. On CUDA, with the layer's kernels
on, the products read the FP8 weight directly (``kernels.fp8_linear``, ``kernels.fused_moe``'s FP8 path), each
tile dequantized in the kernel.

The experts' gate/up scales are ``[E, 2 * ceil(I / b0), ceil(H / b1)]``: the gate rows' blocks, then the up
rows' (each half blocked on its own, as the checkpoint's separate gate_proj and up_proj are), so an
intermediate size that is not a multiple of the block still stacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.layers.fast_kernels import KernelSwitch
from omni_triton.models.layers.moe import Experts
from omni_triton.models.quantization import FP8_DTYPE, SCALE_SUFFIX, Fp8Scheme, dequantize_fp8, quantize_fp8, scale_shape


def _frozen(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Fp8Linear(KernelSwitch, nn.Module):
    # the kernels' scheme: False w8a16 (bf16 activations, the torch path's product), True w8a8 (activations
    # quantized per row and block of columns, FP8 tensor cores; ``set_fp8_activations``)
    act_quant: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int],
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = _frozen(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale_inv = _frozen(*scale_shape(out_features, in_features, block), dtype=torch.float32)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.weight_scale_inv, self.bias)

    def product(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ dequant(weight).T (+ bias)`` under this layer's switches: its own parameters (``forward``) or the
        packed ones of it and its siblings (``layers.fp8_packed``), which share its block."""
        if self.kernels_for(x):
            from omni_triton.kernels.fp8_linear import fp8_linear, supports

            if supports(self.block):
                # the small-row launches where bf16's decode-step linears take theirs (``fast_kernels.step_linear``)
                small_rows = self.use_fused_steps and self.linear_launch == "gemv"
                return fp8_linear(x, weight, weight_scale_inv, self.block, bias, act_quant=self.act_quant,
                                  small_rows=small_rows)
        return F.linear(x, dequantize_fp8(weight, weight_scale_inv, self.block, x.dtype), bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


class Fp8Experts(Experts):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, block: tuple[int, int]):
        nn.Module.__init__(self)
        self.block = block
        gate_blocks, hidden_blocks = scale_shape(intermediate_size, hidden_size, block)
        self.gate_up_proj = _frozen(num_experts, 2 * intermediate_size, hidden_size, dtype=FP8_DTYPE)
        self.gate_up_proj_scale_inv = _frozen(num_experts, 2 * gate_blocks, hidden_blocks, dtype=torch.float32)
        self.down_proj = _frozen(num_experts, hidden_size, intermediate_size, dtype=FP8_DTYPE)
        self.down_proj_scale_inv = _frozen(num_experts, *scale_shape(hidden_size, intermediate_size, block),
                                           dtype=torch.float32)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inter = self.gate_up_proj.shape[1] // 2
        gate_blocks = self.gate_up_proj_scale_inv.shape[1] // 2
        gate_up = torch.cat([dequantize_fp8(self.gate_up_proj[:, half * inter:(half + 1) * inter],
                                            self.gate_up_proj_scale_inv[:, half * gate_blocks:(half + 1) * gate_blocks],
                                            self.block, dtype) for half in (0, 1)], dim=1)
        return gate_up, dequantize_fp8(self.down_proj, self.down_proj_scale_inv, self.block, dtype)

    def fp8_scales(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        return self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block


FP8_ACTIVATIONS = ("bf16", "fp8")  # w8a16, w8a8


def set_fp8_activations(model: nn.Module, activations: str) -> None:
    """Which scheme the FP8 linears' kernels run: "bf16" (w8a16, the default) or "fp8" (w8a8, dynamic scales)."""
    if activations not in FP8_ACTIVATIONS:
        raise ValueError(f"FP8 activations must be one of {', '.join(FP8_ACTIVATIONS)}; got {activations!r}")
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.act_quant = activations == "fp8"


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, (Fp8Linear, Fp8Experts))


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first parameter that is neither an FP8 weight nor a block scale (an
    FP8 layer's first parameters are float8 and float32: neither is the activations' dtype)."""
    return next(p.dtype for name, p in model.named_parameters()
                if p.dtype != FP8_DTYPE and not name.endswith(SCALE_SUFFIX))


def quantize_modules_(root: nn.Module, scheme: Fp8Scheme, selected) -> list[str]:
    """Replace every module of ``root`` that ``selected(name, module)`` picks (``nn.Linear`` or ``Experts``) by
    its FP8 twin (on the meta device, before the weights are loaded); returns the replaced names."""
    replaced = []
    for name, module in list(root.named_modules()):
        if not name or not selected(name, module):
            continue
        if isinstance(module, nn.Linear):
            twin = Fp8Linear(module.in_features, module.out_features, module.bias is not None, scheme.block,
                             module.weight.dtype)
        elif isinstance(module, Experts):
            num_experts, hidden, inter = module.down_proj.shape[0], module.down_proj.shape[1], module.down_proj.shape[2]
            twin = Fp8Experts(num_experts, hidden, inter, scheme.block)
        else:
            raise ValueError(f"module {name!r} ({type(module).__name__}) has no FP8 form")
        _replace(root, name, twin)
        replaced.append(name)
    return replaced


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name), leaf, module)


def quantized_copy(model: nn.Module, scheme: Fp8Scheme | None = None) -> nn.Module:
    """A copy of ``model`` whose modules quantizing at load converts (``quantization.quantized_at_load``) are FP8
    twins holding its weights quantized; every other tensor copied as it is (what accuracy measurements compare
    against ``model``). Whatever the component: the thinker as ``--quantization fp8`` serves it, the talker as the
    loaders' ``fp8_everywhere`` builds it (served in the model dtype: ``quantization.served_in_fp8``)."""
    import copy

    from omni_triton.models.quantization import quantized_at_load

    scheme = scheme or Fp8Scheme()
    # the modules to convert leave the model while it is copied: the copy never holds their full-precision weights
    converted = {name: module for name, module in model.named_modules() if name and quantized_at_load(name, module)}
    for name in converted:
        _replace(model, name, nn.Identity())
    try:
        twin = copy.deepcopy(model)
    finally:
        for name, module in converted.items():
            _replace(model, name, module)
    for name, module in converted.items():
        _replace(twin, name, module)  # shared for a moment: replaced below by its FP8 twin
    device = next(model.parameters()).device
    with torch.device(device):
        replaced = quantize_modules_(twin, scheme, lambda name, module: name in converted)
    with torch.no_grad():
        for name in replaced:
            source, target = model.get_submodule(name), twin.get_submodule(name)
            if isinstance(target, Fp8Linear):
                store_quantized_(target.weight, target.weight_scale_inv, source.weight, scheme.block)
                if source.bias is not None:
                    target.bias.copy_(source.bias)
            else:
                store_quantized_(target.gate_up_proj, target.gate_up_proj_scale_inv, source.gate_up_proj,
                                 scheme.block, halves=2)
                store_quantized_(target.down_proj, target.down_proj_scale_inv, source.down_proj, scheme.block)
    return twin


def store_quantized_(weight: torch.Tensor, scale_inv: torch.Tensor, full: torch.Tensor, block: tuple[int, int],
                     halves: int = 1) -> None:
    """Quantize ``full`` (the weight's shape, any float dtype) into ``weight`` and ``scale_inv`` in place;
    ``halves`` 2: the experts' stacked gate/up, each half blocked on its own. Stacked experts go one at a time,
    so the fp32 temporaries stay one expert's size."""
    if full.shape != weight.shape:
        raise ValueError(f"cannot quantize a {tuple(full.shape)} tensor into a {tuple(weight.shape)} weight")
    if weight.dim() == 3:
        for expert in range(weight.shape[0]):
            store_quantized_(weight[expert], scale_inv[expert], full[expert], block, halves)
        return
    rows, blocks = weight.shape[0] // halves, scale_inv.shape[0] // halves
    for half in range(halves):
        quantized, scales = quantize_fp8(full[half * rows:(half + 1) * rows], block)
        weight[half * rows:(half + 1) * rows].copy_(quantized)
        scale_inv[half * blocks:(half + 1) * blocks].copy_(scales)

