"""Dilated convolutions over their input's phases (``omni_triton/models/code2wav/phase_conv.py``,
``--code2wav-dilated-phases``): the same outputs as the dilated conv, alone (fp64, every dilation, lengths that do
not divide, depthwise, bias) and inside Code2Wav's one-pass and stateful streaming decodes; the runtime switches it
on for CUDA only, and the flag reaches the code2wav stage. GPU (skipped without CUDA): the full-size dilated convs
in bf16 against cuDNN's own, and stream chunks that replay CUDA graphs equal to the one pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _code2wav_helpers import assert_equals_one_pass, calibrate_output_gain_, stream_ramp
from omni_triton import cli
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.models.code2wav.phase_conv import dilated_conv_as_phases
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.models.code2wav.vocoder import set_phase_split
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.pipeline.code2wav.warmup import stage_graph_settings
from omni_triton.shared.settings import LaunchConfig
from server_fixture import rendered_settings

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _conv(channels: int, out_channels: int, kernel: int, dilation: int, groups: int = 1, dtype=torch.float64,
          device="cpu") -> nn.Conv1d:
    torch.manual_seed(kernel * 100 + dilation)
    return nn.Conv1d(channels, out_channels, kernel, dilation=dilation, groups=groups).to(device, dtype)


@pytest.mark.parametrize("dilation", [1, 2, 3, 9])
@pytest.mark.parametrize("length", [61, 63])  # inputs whose phases differ in length, and (63 + 6d, d 3 or 9) not
@pytest.mark.parametrize("kernel, groups", [(7, 1), (3, 1), (7, 6)])
def test_phases_give_the_dilated_convs_outputs(dilation, length, kernel, groups):
    conv = _conv(6, 6, kernel, dilation, groups)
    x = torch.randn(2, 6, length + (kernel - 1) * dilation, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = conv(x)
        got = dilated_conv_as_phases(conv, x)
    assert got.shape == expected.shape == (2, 6, length)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_phases_refuse_strided_or_padded_convs_and_inputs_shorter_than_the_reach():
    with pytest.raises(ValueError, match="stride-1 unpadded"):
        dilated_conv_as_phases(nn.Conv1d(2, 2, 3, stride=2), torch.zeros(1, 2, 20))
    with pytest.raises(ValueError, match="stride-1 unpadded"):
        dilated_conv_as_phases(nn.Conv1d(2, 2, 3, padding=1), torch.zeros(1, 2, 20))
    with pytest.raises(ValueError, match="shorter than the conv's reach 19"):
        dilated_conv_as_phases(nn.Conv1d(2, 2, 7, dilation=3), torch.zeros(1, 2, 18))


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint):
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint)
    calibrate_output_gain_(runtime.model)
    return runtime


def test_the_one_pass_and_the_stream_equal_the_dilated_model(runtime):
    """The switch flipped on the model's own convs (as the runtime does on a GPU): its one-pass decode and a
    stateful stream of 4, 8, 4 frames (state carried across calls) equal the model without it."""
    codes = torch.randint(0, runtime.config.codebook_size, (2, runtime.num_quantizers, 16),
                          generator=torch.Generator().manual_seed(1))
    try:
        assert set_phase_split(runtime.model, False) >= 2  # the residual units' dilations 3 and 9
        expected = runtime.decode(codes)
        set_phase_split(runtime.model, True)
        torch.testing.assert_close(runtime.decode(codes), expected, rtol=0, atol=1e-5)  # fp32 sums' order
        for row, samples in enumerate(stream_ramp(runtime, codes, [4, 8, 4])):
            torch.testing.assert_close(samples, expected[row], rtol=0, atol=1e-5)
    finally:
        set_phase_split(runtime.model, False)


def test_the_runtime_leaves_the_cpu_path_dilated(tiny_checkpoint):
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, dilated_phases=True)
    assert not any(getattr(m, "phase_split", False) for m in runtime.model.modules())


@pytest.mark.parametrize("flag, expected", [([], True), (["--code2wav-dilated-phases", "off"], False)])
def test_the_flag_reaches_the_code2wav_stage(tiny_checkpoint, tmp_path, flag, expected):
    args = cli.build_parser().parse_args(["serve", *flag])
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, **{
        name: value for name, value in flag_settings(args).items() if name == "code2wav_dilated_phases"})
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    assert rendered_settings(out, "code2wav").code2wav_dilated_phases is expected


# ---------------------------------------------------------------- GPU

@cuda
@pytest.mark.parametrize("channels, length, dilation", [(768, 800, 3), (768, 800, 9), (384, 4000, 9),
                                                        (96, 48000, 9)])
def test_full_size_dilated_convs_in_bf16_match_cudnns(channels, length, dilation):
    """The full-size decoder's dilated convs at batch 8 (bf16, the heuristic's picks both ways): within bf16
    rounding of each other, both against an fp32 reference."""
    conv = _conv(channels, channels, 7, dilation, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(8, channels, length + 6 * dilation, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(channels))
    with torch.no_grad():
        reference = nn.functional.conv1d(x.float(), conv.weight.float(), conv.bias.float(), dilation=dilation)
        direct, phases = conv(x).float(), dilated_conv_as_phases(conv, x).float()
    scale = reference.abs().max().item()
    assert (phases - reference).abs().max().item() <= max(2 * (direct - reference).abs().max().item(), 1e-2 * scale)


@cuda
def test_stream_chunks_with_phases_replay_graphs_and_equal_the_one_pass(tiny_checkpoint):
    graphs = stage_graph_settings(ChunkPolicy.from_setting(4, 25, "stateful"), max_batch=2, warm_start=False)
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, device="cuda", cuda_graphs=True,
                                     dilated_phases=True, **graphs)
    assert set_phase_split(runtime.model, True) >= 2  # the runtime set them; (re)setting is a no-op
    calibrate_output_gain_(runtime.model)
    ramp = [4, 8, 24, 25]
    codes = torch.randint(0, runtime.config.codebook_size, (2, runtime.num_quantizers, sum(ramp)),
                          generator=torch.Generator().manual_seed(5)).cuda()
    replays = runtime.stream_graphs.replays
    streamed = stream_ramp(runtime, codes, ramp)
    assert runtime.stream_graphs.replays == replays + len(ramp)
    set_phase_split(runtime.model, False)
    assert_equals_one_pass(runtime, codes, streamed)  # against the dilated convs themselves
