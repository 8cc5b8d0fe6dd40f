"""Programmatic dependent launch (``kernels.dependent_launch``): the switch, where it reaches, and on an sm_90+
GPU that a chain of PDL kernels (eager and under a CUDA graph) gives the same bits as the same chain without it."""

import pytest
import torch
import torch.nn.functional as F

from omni_triton.kernels import dependent_launch
from omni_triton.kernels.dependent_launch import enabled_for, set_dependent_launch
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from server_fixture import rendered_settings

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
hopper = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs an sm_90+ GPU")


@pytest.fixture
def restore_switch():
    before = dependent_launch.dependent_launch_on()
    yield
    set_dependent_launch(before)


def test_off_for_cpu_tensors_whatever_the_switch(restore_switch):
    set_dependent_launch(True)
    assert dependent_launch.dependent_launch_on()
    assert not enabled_for(torch.zeros(2))
    set_dependent_launch(False)
    assert not dependent_launch.dependent_launch_on()


@pytest.mark.parametrize("on", [True, False])
def test_the_switch_reaches_both_engines_configs(tiny_checkpoint, tmp_path, on):
    from omni_triton.stages.model_args import engine_config

    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", fast_path=True,
                                         dependent_launch=on), tmp_path / "repository")
    for stage in ("thinker", "talker"):
        config, _ = engine_config(rendered_settings(out, stage), stage, torch.device("cpu"))
        assert config.dependent_launch is on, stage


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """Linears (GEMV, split-K or one-pass by the row count), norms and a torch op between them: every kind of
    neighbour a PDL kernel has in a step."""
    from omni_triton.kernels.norm import rms_norm
    from omni_triton.kernels.small_linear import small_linear

    for i, weight in enumerate(weights):
        if i % 3 == 0:
            x = small_linear(x, weight, norm_weight=norm, eps=1e-6, gemv=True)
        elif i % 3 == 1:
            x = small_linear(x, weight, residual=x, gemv=True)
        else:
            x = rms_norm(F.silu(small_linear(x, weight, gemv=True)), norm, 1e-6)
    return x


@hopper
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_pdl_chain_gives_the_bits_of_the_plain_chain(restore_switch, rows):
    gen = torch.Generator().manual_seed(rows)
    weights = [(torch.randn(1024, 1024, generator=gen) / 32).to("cuda", torch.bfloat16) for _ in range(30)]
    norm = torch.rand(1024, generator=gen).to("cuda", torch.bfloat16) + 0.5
    x = torch.randn(rows, 1024, generator=gen).to("cuda", torch.bfloat16)
    set_dependent_launch(False)
    want = _chain(x, weights, norm)
    set_dependent_launch(True)
    assert enabled_for(x)
    assert torch.equal(_chain(x, weights, norm), want)

    static_x = torch.zeros_like(x)
    _chain(static_x, weights, norm)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _chain(static_x, weights, norm)
    for _ in range(3):
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, want)


@hopper
def test_pdl_kernels_wait_and_prefetch(restore_switch):
    """The compiled GEMV under PDL waits for its predecessor and prefetches its weights (and without it, neither)."""
    from omni_triton.kernels import small_linear as module

    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    for on in (True, False):
        set_dependent_launch(on)
        module.small_linear(x, weight, gemv=True)
        compiled = [kernel for kernel in module._gemv_kernel.device_caches[0][0].values()
                    if kernel.metadata.launch_pdl == on]
        assert compiled, on
        ptx = compiled[-1].asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == on and ("prefetch.global.L2" in ptx) == on
