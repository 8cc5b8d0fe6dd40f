"""The fused SnakeBeta kernel (``kernels.snake``) and its switch (``--code2wav-triton-snake``).

CPU (Triton's interpreter, ``TRITON_INTERPRET=1`` from conftest.py; small shapes): the kernel against an fp64
reference in fp32, fp16 and bf16, at odd channel and sample counts (masked blocks) and batch > 1, strided inputs
as their contiguous copies, inputs that do not fit refused naming the argument; the switch on a tiny Code2Wav gives
the torch path's waveform; the runtime leaves the CPU on the torch path. (The flag reaching the code2wav stage:
tests/test_code2wav_graphs.py.)

GPU (skipped without CUDA): full-size shapes in bf16 against the torch path, and closer to the exact value than it;
stateful stream chunks with the switch on replay CUDA graphs and equal the one pass.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from _code2wav_helpers import calibrate_output_gain_  # noqa: E402
from omni_triton.kernels import snake  # noqa: E402
from omni_triton.models.code2wav.runtime import Code2WavRuntime  # noqa: E402
from omni_triton.models.code2wav.vocoder import SnakeBeta  # noqa: E402
from omni_triton.models.layers.fast_kernels import KernelSwitch, set_fast_kernels  # noqa: E402
from omni_triton.models.weights import load_code2wav  # noqa: E402
from test_code2wav_graphs import random_codes, stage_streams_replay_the_one_pass  # noqa: E402
from test_small_linear_gemv import RecordingKernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def activation(channels: int, dtype: torch.dtype, seed: int, device=DEVICE) -> SnakeBeta:
    """A SnakeBeta with log-scale parameters spread around 0, as a checkpoint's are."""
    generator = torch.Generator().manual_seed(seed)
    module = SnakeBeta(channels)
    with torch.no_grad():
        module.alpha.copy_(0.5 * torch.randn(channels, generator=generator))
        module.beta.copy_(0.5 * torch.randn(channels, generator=generator))
    return module.to(device, dtype)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    """Activations of a few units either side of 0 (sin's argument over several periods)."""
    return (3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


def constants(module: SnakeBeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^alpha, 1 / (e^beta + 1e-9)) [1, C, 1] in fp64."""
    return (module.alpha.detach().double().exp()[None, :, None],
            1.0 / (module.beta.detach().double().exp()[None, :, None] + 1e-9))


def exact(x: torch.Tensor, module: SnakeBeta) -> torch.Tensor:
    """The activation of x's and the parameters' values in fp64."""
    scale, inverse = constants(module)
    return x.double() + inverse * torch.sin(x.double() * scale) ** 2


def rounded_scale(x: torch.Tensor, module: SnakeBeta) -> torch.Tensor:
    """Per element, what a rounding step (relative) can move the result by: x, the sine term (up to 1 / e^beta),
    and the sine's argument x e^alpha (a step of it moves the term by up to that step / e^beta)."""
    scale, inverse = constants(module)
    return x.double().abs() + inverse * (1 + (x.double() * scale).abs())


def assert_rounded_once(got: torch.Tensor, x: torch.Tensor, module: SnakeBeta) -> None:
    """Within one step of the output dtype of the exact value (the interpreter rounds to bf16 by truncation, the
    GPU to nearest), plus fp32's error inside: a few fp32 steps of ``rounded_scale`` (on the GPU the exponential
    and the sine are the hardware's approximations, a few fp32 steps off)."""
    want = exact(x, module)
    bound = torch.finfo(got.dtype).eps * want.abs() + 16 * torch.finfo(torch.float32).eps * rounded_scale(x, module)
    assert ((got.double() - want).abs() <= bound).all()


def assert_torch_path_to_bf16_rounding(got: torch.Tensor, x: torch.Tensor, module: SnakeBeta) -> torch.Tensor:
    """Within three bf16 steps of ``rounded_scale`` of the torch path, about what its seven roundings (e^alpha, the
    argument, e^beta's reciprocal, the sine, its square, the product, the sum) and the kernel's one add up to at
    most; that path's output."""
    with torch.inference_mode():
        want = module(x)  # use_kernels off: the module's default
    bound = 3 * torch.finfo(torch.bfloat16).eps * rounded_scale(x, module)
    assert ((got.double() - want.double()).abs() <= bound).all()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 301), (2, 5, 1500)])  # odd C and T; T past one block
def test_the_kernel_is_the_exact_activation_rounded_once(dtype, shape):
    module = activation(shape[1], dtype, seed=sum(shape))
    x = inputs(shape, dtype, seed=len(shape) + shape[-1])
    got = snake.snake_beta(x, module.alpha, module.beta)
    assert got.dtype == dtype and got.shape == x.shape
    assert_rounded_once(got, x, module)


def test_strided_inputs_give_what_their_contiguous_copies_give():
    """The decoder hands over views: a transposed conv's trimmed output (the samples sliced), or a transpose."""
    module = activation(6, torch.float32, seed=1)
    sliced = inputs((2, 6, 260), torch.float32, seed=2)[..., 3:-3]
    transposed = inputs((2, 130, 6), torch.float32, seed=3).transpose(1, 2)
    for x in (sliced, transposed):
        assert not x.is_contiguous()
        got = snake.snake_beta(x, module.alpha, module.beta)
        assert got.is_contiguous() and torch.equal(got, snake.snake_beta(x.contiguous(), module.alpha, module.beta))


def test_an_input_without_samples_gives_an_empty_output():
    module = activation(4, torch.float32, seed=0)
    assert snake.snake_beta(torch.empty(2, 4, 0, device=DEVICE), module.alpha, module.beta).shape == (2, 4, 0)


def test_in_bf16_the_kernel_is_the_torch_path_to_bf16_rounding():
    module = activation(7, torch.bfloat16, seed=5)
    x = inputs((3, 7, 301), torch.bfloat16, seed=6)
    assert_torch_path_to_bf16_rounding(snake.snake_beta(x, module.alpha, module.beta), x, module)


@pytest.mark.parametrize("change, argument", [
    (dict(x=torch.zeros(4, 8)), "x"),
    (dict(x=torch.zeros(1, 4, 8, dtype=torch.float64)), "x"),
    (dict(alpha=torch.zeros(5)), "alpha"),
    (dict(beta=torch.zeros(4, 1)), "beta"),
    (dict(beta=torch.zeros(4, dtype=torch.long)), "beta"),
    (dict(alpha=torch.zeros(4, device="meta")), "alpha"),
])
def test_inputs_that_do_not_fit_are_refused_naming_the_argument(change, argument):
    call = dict(x=torch.zeros(1, 4, 8), alpha=torch.zeros(4), beta=torch.zeros(4)) | change
    with pytest.raises(ValueError, match=f"snake_beta {argument} "):
        snake.snake_beta(**call)


# ---------------------------------------------------------------- the switch

def test_the_switch_on_a_tiny_code2wav_gives_the_torch_paths_waveform(tiny_checkpoint, monkeypatch):
    """Every SnakeBeta of a decode (29: one per decoder block, two per residual unit, the last one) is one launch;
    the waveform is the torch path's to fp32 rounding through the decoder's gain (on the GPU, to TF32's: a last-bit
    difference in an activation can move a convolution input's TF32 rounding). On the CPU the kernels run
    interpreted: ``kernels_for`` patched to take CPU tensors, as tests/test_step_linears.py does."""
    monkeypatch.setattr(KernelSwitch, "kernels_for", lambda self, x: self.use_kernels)
    launched = []
    monkeypatch.setattr(snake, "_snake_beta_kernel", RecordingKernel(snake._snake_beta_kernel, launched))
    model = calibrate_output_gain_(load_code2wav(tiny_checkpoint, DEVICE), num_frames=8)
    codes = torch.randint(0, model.config.codebook_size, (2, model.num_quantizers, 2),
                          generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.inference_mode():
        want = model(codes)
        assert not launched  # off by default
        set_fast_kernels(model, True)
        got = model(codes)
    assert len(launched) == 29
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if DEVICE == "cpu" else 5e-3)


def snake_switches(runtime: Code2WavRuntime) -> set[bool]:
    return {module.use_kernels for module in runtime.model.modules() if isinstance(module, SnakeBeta)}


def test_the_runtime_leaves_the_cpu_on_the_torch_path(tiny_checkpoint):
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, triton_snake=True)
    assert snake_switches(runtime) == {False}
    codes = random_codes(runtime, 2, 3, seed=3)
    with torch.inference_mode():
        assert torch.equal(runtime.decode(codes), runtime.model(codes).float())


# ---------------------------------------------------------------- GPU

@cuda
@pytest.mark.parametrize("shape", [(8, 96, 48000), (8, 1536, 100), (8, 384, 4000)])
def test_full_size_shapes_in_bf16_match_the_torch_path_and_are_closer_to_exact(shape):
    """Shapes of a served stateful call at batch 8 x 25 new frames (its last, first and a middle SnakeBeta): the
    torch path to bf16 rounding, and at least as close to the exact value as it (rounded once where the torch
    path rounds after each op); in fp32, the exact value to fp32's error."""
    module = activation(shape[1], torch.bfloat16, seed=shape[1])
    x = inputs(shape, torch.bfloat16, seed=shape[2])
    got = snake.snake_beta(x, module.alpha, module.beta)
    want = assert_torch_path_to_bf16_rounding(got, x, module)
    reference = exact(x, module)
    assert (got.double() - reference).norm() <= (want.double() - reference).norm()
    assert_rounded_once(got, x, module)
    x, module = x.float(), module.float()
    assert_rounded_once(snake.snake_beta(x, module.alpha, module.beta), x, module)


@cuda
def test_stream_chunks_with_the_triton_snake_replay_and_equal_the_one_pass(tiny_checkpoint):
    """``--code2wav-triton-snake on``: the kernel, compiled by the warm-up calls before each capture, is what the
    graphs replay; two streams still equal the one pass."""
    runtime = stage_streams_replay_the_one_pass(tiny_checkpoint, seed=45, triton_snake=True)
    assert snake_switches(runtime) == {True}
