"""The code2wav stage's per-stream state store (omni_triton/pipeline/code2wav/stream_states.py) and the stateful
chunk policy, on the CPU: streams interleaved in batched calls equal their one-pass decodes; slots grow and
are reused; bad streams are errors that leave the others decoding; idle streams are evicted."""

from __future__ import annotations

import argparse

import pytest
import torch

from _code2wav_helpers import one_torch_thread  # noqa: F401 (fixture)
from omni_triton.checkpoints.tiny import build
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates, StreamChunk
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy, Code2WavStream
from omni_triton.launch.options import left_context_setting

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return Code2WavRuntime.create("torch", build(tmp_path_factory.mktemp("tiny8g"), "tiny-8g"))


def store(runtime, **kwargs) -> Code2WavStreamStates:
    return Code2WavStreamStates(runtime.decode_stream, runtime.state_specs(), runtime.streaming_samples,
                                runtime.device, **kwargs)


def codes_for(runtime, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, runtime.config.codebook_size, (runtime.num_quantizers, frames),
                         generator=torch.Generator().manual_seed(seed))


def test_interleaved_streams_grow_the_slots_and_equal_one_pass(runtime):
    states = store(runtime, initial_slots=1)
    streams = {f"s{i}": codes_for(runtime, 30, seed=i) for i in range(3)}
    splits = {"s0": [4, 8, 18], "s1": [1, 29], "s2": [10, 10, 10]}
    audio = {sid: [] for sid in streams}
    for call in range(3):
        due = [(sid, split[call]) for sid, split in splits.items() if call < len(split)]
        chunks = [StreamChunk(sid, streams[sid][:, sum(splits[sid][:call]):sum(splits[sid][:call + 1])], call == 0)
                  for sid, _ in due]
        for (sid, _), samples in zip(due, states.decode(chunks)):
            audio[sid].append(samples)
    assert states.capacity >= 3 and states.open_streams == 3
    for sid, codes in streams.items():
        expected = runtime.decode(codes[None])[0]
        assert (torch.cat(audio[sid]) - expected).abs().max().item() <= 1e-4, sid
        assert states.close(sid)
    assert states.open_streams == 0 and not states.close("s0")
    # a freed slot is reused, zeroed: a new stream starts from a fresh state
    (samples,) = states.decode([StreamChunk("again", streams["s1"][:, :5], first=True)])
    assert (samples - runtime.decode(streams["s1"][None, :, :5])[0]).abs().max().item() <= 1e-4


def test_a_bad_chunk_is_an_error_and_the_others_decode(runtime):
    states = store(runtime)
    codes = codes_for(runtime, 8, seed=5)
    states.decode([StreamChunk("open", codes[:, :4], first=True), StreamChunk("other", codes[:, :4], first=True)])
    results = states.decode([StreamChunk("unknown", codes[:, :4], first=False),
                             StreamChunk("open", codes[:, 4:], first=False),
                             StreamChunk("open", codes[:, 4:], first=False),
                             StreamChunk("other", codes[:, :4], first=True)])
    assert isinstance(results[0], ValueError) and "'unknown' is not a stream" in str(results[0])
    assert (results[1] - runtime.decode(codes[None])[0][4 * runtime.samples_per_frame
                                                      - runtime.trim_samples:]).abs().max().item() <= 1e-4
    assert "two chunks of one stream in one call" in str(results[2])
    assert "already open" in str(results[3])


def test_idle_streams_are_evicted(runtime):
    now = [0.0]
    states = store(runtime, idle_timeout_s=10.0, clock=lambda: now[0])
    codes = codes_for(runtime, 4, seed=2)
    states.decode([StreamChunk("a", codes, True), StreamChunk("b", codes, True)])
    now[0] = 8.0
    states.decode([StreamChunk("b", codes, False)])
    now[0] = 12.0
    assert states.evict_idle() == ["a"] and states.open_streams == 1


def test_stateful_policy_sends_new_frames_only():
    stream = Code2WavStream(ChunkPolicy.from_setting(4, 25, "stateful"), num_quantizers=2)
    frames = torch.arange(120).view(60, 2)
    stream.append(frames)
    jobs = []
    while (job := stream.next_job(final=True)) is not None:
        jobs.append(job)
    assert [(j.context_frames, j.new_frames, j.start_frame) for j in jobs] == [
        (0, 4, 0), (0, 8, 4), (0, 24, 12), (0, 24, 36)]
    assert torch.equal(torch.cat([j.codes for j in jobs], dim=1), frames.T)
    assert ChunkPolicy.from_setting(4, 25, "stateful").max_frames_per_call() == 25
    assert ChunkPolicy.from_setting(4, 25, "exact").left_context_frames is None
    assert ChunkPolicy.from_setting(4, 25, "12").left_context_frames == 12
    with pytest.raises(ValueError, match="'sometimes' is not 'stateful'"):
        ChunkPolicy.from_setting(4, 25, "sometimes")


def test_left_context_launch_setting():
    assert [left_context_setting(v) for v in ("stateful", "exact", "25")] == ["stateful", "exact", 25]
    for bad in ("0", "none", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="stateful, exact or a frame count"):
            left_context_setting(bad)
