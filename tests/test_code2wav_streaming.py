"""Stateful streaming Code2Wav (omni_triton/models/code2wav/stateful.py) against the one-pass decode.

Every split of a code sequence into chunks (1 frame at a time, ragged, 25, the 4/8/24/25 ramp, random), decoded
with the per-layer state carried across chunks, must give the one-pass waveform: to ~1e-12 in float64 (any
state bug shows there), within fp32 rounding in float32. Streams at different points batched in one call
(first chunks beside later ones, ragged lengths) must not see each other.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from _code2wav_helpers import calibrate_output_gain_, one_torch_thread, stateful_decode  # noqa: F401 (fixture)
from omni_triton.checkpoints.tiny import build
from omni_triton.models.weights import load_code2wav
from omni_triton.models.code2wav.vocoder import Code2Wav, Code2WavConfig
from omni_triton.models.code2wav.stateful import StreamingCode2Wav

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RAMP = [4, 8, 24, 25, 25]  # ChunkPolicy()'s sizes: 86 frames


def wide_config(base: Code2WavConfig) -> Code2WavConfig:
    """Wider than the tiny presets and shaped differently: 3 layers, grouped KV heads, a short window (so the KV
    cache wraps many times), other rates (kernel 2r transposed convs at r = 2, 3, 5)."""
    return dataclasses.replace(base, hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                               num_key_value_heads=2, head_dim=16, intermediate_size=192, sliding_window=9,
                               upsampling_ratios=(3,), upsample_rates=(5, 3, 2), decoder_dim=48)


@pytest.fixture(scope="module", params=["tiny", "tiny-8g", "wide"])
def model64(request, tmp_path_factory):
    """float64 models: rounding ~1e-15, so a wrong state (one sample off, a stale key) cannot hide."""
    preset = "tiny" if request.param == "wide" else request.param
    model = load_code2wav(build(tmp_path_factory.mktemp(preset), preset))
    if request.param == "wide":
        torch.manual_seed(3)
        model = Code2Wav(wide_config(model.config)).eval()
    return model.double()


def codes_for(model, batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.codebook_size, (batch, model.num_quantizers, frames),
                         generator=torch.Generator().manual_seed(seed))


def one_pass(model, codes):
    with torch.inference_mode():
        return model(codes)


@pytest.mark.parametrize("split", [[1] * 30, [3, 1, 7, 2, 11, 5], [25, 25, 25], RAMP, [80, 1]],
                         ids=["one-frame", "ragged", "25", "ramp", "long-then-last"])
def test_stateful_chunks_equal_one_pass(model64, split):
    codes = codes_for(model64, 1, sum(split), seed=len(split))
    reference = one_pass(model64, codes)[0]
    (streamed,) = stateful_decode(StreamingCode2Wav(model64), codes, [split])
    # the last chunk's samples end where the one pass ends: nothing held back beyond its own lookahead trim
    assert streamed.shape == reference.shape == (model64.output_length(sum(split)),)
    assert (streamed - reference).abs().max().item() <= 1e-10


def test_streams_at_different_points_batch_together(model64):
    """Four streams in the same calls: ragged chunks, two starting late (first chunks beside later chunks)."""
    splits = [RAMP, [1] * 6 + [30, 2], [9, 9, 9, 9, 9, 9], [2, 25, 25, 3]]
    codes = codes_for(model64, len(splits), max(sum(s) for s in splits), seed=7)
    streamed = stateful_decode(StreamingCode2Wav(model64), codes, splits, first_call=[0, 0, 2, 3])
    for b, split in enumerate(splits):
        reference = one_pass(model64, codes[b:b + 1, :, :sum(split)])[0]
        assert (streamed[b] - reference).abs().max().item() <= 1e-10, f"stream {b}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(split=st.lists(st.integers(1, 30), min_size=1, max_size=6), seed=st.integers(0, 2**16))
@example(split=[16, 27, 21, 30], seed=278)  # 1.5e-8 off on "tiny" while the norm rounded fp64 inputs to fp32
def test_any_split_equals_one_pass(model64, split, seed):
    codes = codes_for(model64, 1, sum(split), seed)
    (streamed,) = stateful_decode(StreamingCode2Wav(model64), codes, [split])
    assert (streamed - one_pass(model64, codes)[0]).abs().max().item() <= 1e-10


def test_float32_within_rounding(tmp_path_factory):
    """fp32 (the served dtype on CPU): chunked convs and a masked KV cache round differently from one pass."""
    model = calibrate_output_gain_(load_code2wav(build(tmp_path_factory.mktemp("tiny"), "tiny")))
    codes = codes_for(model, 2, sum(RAMP), seed=1)
    streamed = stateful_decode(StreamingCode2Wav(model), codes, [RAMP, [25, 25, 25, 11]])
    reference = one_pass(model, codes)
    for b in range(2):
        assert (streamed[b] - reference[b]).abs().max().item() <= 1e-4


def test_state_specs_match_initial_state_and_outputs(model64):
    streaming = StreamingCode2Wav(model64)
    specs = streaming.state_specs()
    state = streaming.initial_state(3)
    assert [tuple(t.shape) for t in state] == [(3, *spec.shape) for spec in specs]
    assert len({spec.name for spec in specs}) == len(specs)
    codes = codes_for(model64, 3, 5, seed=0)
    with torch.inference_mode():
        waveform, *new_state = streaming(codes, torch.tensor([5, 2, 1]), *state)
    assert waveform.shape == (3, 5 * model64.samples_per_frame)
    assert [(t.shape, t.dtype) for t in new_state] == [(t.shape, t.dtype) for t in state]
    assert new_state[0].tolist() == [5, 2, 1]


def test_a_row_without_new_frames_keeps_its_state(model64):
    """lengths 0 (a padding row, e.g. of a CUDA graph's batch bucket): fresh or not, the state comes back as it
    went in, so padding rows can never corrupt anything."""
    streaming = StreamingCode2Wav(model64)
    codes = codes_for(model64, 2, 6, seed=2)
    with torch.inference_mode():
        _, *state = streaming(codes, torch.tensor([6, 3]), *streaming.initial_state(2))
        mixed = [torch.cat([t[:1], torch.zeros_like(t[:1])]) for t in state]  # a stream past 6 frames, a fresh one
        _, *after = streaming(codes, torch.tensor([0, 0]), *mixed)
    assert all(torch.equal(a, b) for a, b in zip(after, mixed))


def test_a_call_padded_to_its_frame_bucket_gives_the_calls_samples_and_state(model64):
    """The CUDA-graph path of stream chunks (graphs.py) pads a call's frames up to its frame bucket and its batch
    up to its batch bucket (``fill_padded_frames``, ``fill_padded``) and cuts the waveform back
    (``output_rows``): the same data path run eagerly here, along two streams' ramps (first chunk beside later
    ones), must give the unpadded call's new samples and state (float64: to 1e-10)."""
    from omni_triton.graph_buckets import fill_padded
    from omni_triton.models.code2wav.graphs import fill_padded_frames, graph_key, output_rows, stream_frame_buckets

    streaming = StreamingCode2Wav(model64)
    frame_buckets, batch_buckets = stream_frame_buckets(32, (4, 8, 24, 25)), (1, 2, 4)
    calls = [[5, 0], [9, 4], [13, 8], [25, 17]]  # new frames per stream per call (0: not in the call)
    codes = codes_for(model64, 2, 52, seed=11)
    plain, padded = streaming.initial_state(2), streaming.initial_state(2)
    done = [0, 0]
    for lengths in calls:
        rows = [b for b in range(2) if lengths[b]]
        n = max(lengths[b] for b in rows)
        chunk = torch.stack([torch.nn.functional.pad(codes[b, :, done[b]:done[b] + lengths[b]],
                                                     (0, n - lengths[b])) for b in rows])
        lens = torch.tensor([lengths[b] for b in rows])
        bucket, bucket_frames = graph_key(len(rows), n, batch_buckets, 32, frame_buckets)
        state_in = [t[rows] for t in plain]
        static_codes = torch.full((bucket, model64.num_quantizers, bucket_frames), 5, dtype=torch.long)
        fill_padded_frames(static_codes, chunk)
        static = [torch.full((bucket, *t.shape[1:]), 3, dtype=t.dtype) for t in (lens, *state_in)]
        for tensor, value in zip(static, (lens, *[t[rows] for t in padded])):
            fill_padded(tensor, value, bucket)
        with torch.inference_mode():
            expected, *expected_state = streaming(chunk, lens, *state_in)
            waveform, *new_state = streaming(static_codes, *static)
        waveform = output_rows(waveform, len(rows), waveform.shape[1] // bucket_frames * n)
        assert waveform.shape == expected.shape
        for i, b in enumerate(rows):
            samples = streaming.new_samples(done[b], lengths[b])
            assert (waveform[i, :samples] - expected[i, :samples]).abs().max().item() <= 1e-10
            for mine, theirs, out, ref in zip(padded, plain, new_state, expected_state):
                mine[b], theirs[b] = out[i], ref[i]
                assert (mine[b] - theirs[b]).abs().max().item() <= 1e-10
            done[b] += lengths[b]
