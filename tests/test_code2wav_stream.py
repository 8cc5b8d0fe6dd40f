"""Streaming Code2Wav (left context only) against a one-pass decode of all frames.

Exactness is checked in float64, where rounding is ~1e-12 and any receptive-field shortfall shows;
the fp32 test pins the tolerance documented in omni_triton/pipeline/code2wav/chunking.py.
"""

from __future__ import annotations

import pytest
import torch

from _code2wav_helpers import calibrate_output_gain_, one_torch_thread  # noqa: F401 (fixture)
from omni_triton.checkpoints.tiny import build
from omni_triton.models.weights import load_code2wav
from omni_triton.models.code2wav.vocoder import exact_left_context_frames
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy, Code2WavStream, StreamDecoder

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module", params=["tiny", "tiny-8g"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def model(checkpoint):
    return calibrate_output_gain_(load_code2wav(checkpoint))


def random_codes(model, num_frames: int, seed: int) -> torch.Tensor:
    """[N, G] frames, as the talker emits them."""
    return torch.randint(0, model.config.codebook_size, (num_frames, model.num_quantizers),
                         generator=torch.Generator().manual_seed(seed))


def stream_decode(model, frames: torch.Tensor, policy: ChunkPolicy, piece: int = 3) -> list[torch.Tensor]:
    """Feed frames in pieces of ``piece`` as they would arrive; decode each chunk as soon as it is due."""
    stream = Code2WavStream(policy.resolved(exact_left_context_frames(model.config)), model.num_quantizers)
    decoder = StreamDecoder(model, model.samples_per_frame, model.trim_samples)
    chunks = []
    with torch.inference_mode():
        for start in range(0, frames.shape[0], piece):
            stream.append(frames[start:start + piece])
            while (job := stream.next_job()) is not None:
                chunks += decoder.decode([job])
        while (job := stream.next_job(final=True)) is not None:
            chunks += decoder.decode([job])
    return chunks


def chunk_errors(chunks: list[torch.Tensor], reference: torch.Tensor) -> list[float]:
    errors, offset = [], 0
    for chunk in chunks:
        errors.append((chunk - reference[offset:offset + chunk.numel()]).abs().max().item())
        offset += chunk.numel()
    return errors


def one_pass(model, frames: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(frames.T[None])[0]


@pytest.mark.parametrize("first, chunk", [(4, 25), (1, 9), (12, 40)])
def test_streaming_equals_one_pass(checkpoint, model, first, chunk):
    """Exact context (the default): every chunk within the fp32 tolerance documented in pipeline/code2wav/chunking.py."""
    if chunk == 9 and model.config.num_hidden_layers > 1:
        pytest.skip("1-frame-first / 9-frame policy runs on tiny-8g only (fewer context frames, faster)")
    frames = random_codes(model, exact_left_context_frames(model.config) + chunk + 7, seed=chunk)
    reference = one_pass(model, frames)
    chunks = stream_decode(model, frames, ChunkPolicy(first, chunk))
    # same total length as one pass: N * spf - trim (the first chunk lacks the trim, later ones are N_i * spf)
    assert sum(c.numel() for c in chunks) == reference.numel() == model.output_length(frames.shape[0])
    assert chunks[0].numel() == first * model.samples_per_frame - model.trim_samples
    policy, decoded, sizes = ChunkPolicy(first, chunk), first, []
    for _ in chunks[1:-1]:
        sizes.append(policy.chunk_size(decoded))
        decoded += sizes[-1]
    assert [c.numel() for c in chunks[1:-1]] == [model.samples_per_frame * n for n in sizes]
    assert max(chunk_errors(chunks, reference)) <= 1e-4


def test_exact_left_context_is_exact_and_tight(checkpoint):
    """In float64 (rounding ~1e-12): the exact context reproduces the one-pass samples, one frame less does not."""
    model64 = load_code2wav(checkpoint, dtype=torch.float64)
    with torch.no_grad():  # the tiny builder damps the decoder's residual branches 10x, which pushes the far
        for name, param in model64.named_parameters():  # edge of the receptive field down to rounding: undo it
            if name.startswith("decoder.") and ".conv2." in name:
                param.mul_(10.0)
    model64 = calibrate_output_gain_(model64)
    exact = exact_left_context_frames(model64.config)
    frames = random_codes(model64, exact + 30, seed=1)
    reference = one_pass(model64, frames)
    for context, inexact in [(exact, False), (exact - 1, True)]:
        policy = ChunkPolicy(first_chunk_frames=exact + 5, chunk_frames=25, left_context_frames=context)
        errors = chunk_errors(stream_decode(model64, frames, policy), reference)
        assert errors[0] <= 1e-9  # the first chunk has no left edge
        assert (errors[1] > 1e-9) == inexact, (context, errors)


def test_batched_streams_equal_per_stream_decode(model):
    exact = exact_left_context_frames(model.config)
    policy = ChunkPolicy(4, 40).resolved(exact)
    streams = [Code2WavStream(policy, model.num_quantizers) for _ in range(3)]
    # different progress per stream: first chunk only, full-context chunks, a short final chunk
    for stream, num_frames in zip(streams, [4, exact + 50, 31]):
        stream.append(random_codes(model, num_frames, seed=num_frames))
    jobs = []
    for stream in streams:
        while (job := stream.next_job(final=True)) is not None:
            jobs.append(job)
    assert len({job.num_frames for job in jobs}) > 2  # the batch mixes chunk lengths (right padding)
    decoder = StreamDecoder(model, model.samples_per_frame, model.trim_samples)
    with torch.inference_mode():
        batched = decoder.decode(jobs)
        single = [decoder.decode([job])[0] for job in jobs]
    for together, alone in zip(batched, single):
        assert together.shape == alone.shape
        assert (together - alone).abs().max().item() <= 1e-4  # fp32 rounding of a different batch shape


def test_chunks_ramp_up_to_the_chunk_size():
    policy = ChunkPolicy(first_chunk_frames=4, chunk_frames=25, left_context_frames=10)
    stream = Code2WavStream(policy, num_quantizers=1)
    stream.append(torch.zeros(60, 1, dtype=torch.long))
    sizes = []
    while (job := stream.next_job(final=True)) is not None:
        sizes.append(job.new_frames)
    # each chunk at most twice the audio before it: made while that audio plays, it arrives in time
    assert sizes == [4, 8, 24, 24]
    assert [policy.chunk_size(n) for n in (0, 4, 12, 36, 1000)] == [4, 8, 24, 25, 25]


def test_stream_chunking_and_buffer_trimming():
    policy = ChunkPolicy(first_chunk_frames=3, chunk_frames=5, left_context_frames=4)
    stream = Code2WavStream(policy, num_quantizers=2)
    frames = torch.arange(40).view(20, 2)
    stream.append(frames[:2])
    assert stream.next_job() is None  # first chunk needs 3 frames
    stream.append(frames[2:9])
    first = stream.next_job()
    assert (first.context_frames, first.new_frames, first.start_frame) == (0, 3, 0)
    second = stream.next_job()
    assert (second.context_frames, second.new_frames, second.start_frame) == (3, 5, 3)
    assert torch.equal(second.codes, frames[0:8].T)
    assert stream.next_job() is None  # 1 frame pending < 5
    stream.append(frames[9:20])
    third = stream.next_job()
    assert torch.equal(third.codes, frames[4:13].T)  # 4 frames of context from the trimmed buffer
    fourth = stream.next_job()
    assert stream.next_job() is None and fourth.new_frames == 5
    last = stream.next_job(final=True)
    assert (last.start_frame, last.new_frames, last.context_frames) == (18, 2, 4)
    assert [job.reason for job in (first, second, third, fourth, last)] == ["first", "ramp", "ramp", "ramp", "final"]
    assert torch.equal(last.codes, frames[14:20].T)
    assert stream.next_job(final=True) is None


def test_policy_rejects_zero_left_context():
    with pytest.raises(ValueError, match="left_context_frames"):
        ChunkPolicy(4, 25, left_context_frames=0)
