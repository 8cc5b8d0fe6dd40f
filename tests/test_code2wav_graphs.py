"""CUDA-graph replay of Code2Wav's short calls (``Code2WavRuntime.create(..., cuda_graphs=True)``).

CPU: the option changes nothing there; the bucket / padding / copy-out logic, the stream frame buckets and the
count of graphs a stage captures at start; the switch reaches the code2wav stage's config.pbtxt and its model.py
passes it to the runtime. GPU (skipped without CUDA): a replay equals the eager call of the same padded shape bit
for bit (same kernels) at the first-chunk size and a lazily captured one, for batch 1 and batch 3 (padded to 4),
also from several threads at once; a warm-started stateful stage's frame-padded stream chunks replay graphs
captured at start and equal the one pass.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

import pytest
import torch

from _code2wav_helpers import assert_equals_one_pass, calibrate_output_gain_, stream_ramp
from omni_triton.graph_buckets import bucket_for, fill_padded
from omni_triton.models.code2wav.graphs import (DEFAULT_MAX_FRAMES, Code2WavGraphs, GraphSettings, batch_buckets,
                                                fill_padded_frames, graph_key, output_rows, stream_frame_buckets)
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.pipeline.code2wav.warmup import capture_count, stage_graph_settings
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton import cli
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from server_fixture import rendered_settings, stage_args

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_codes(runtime: Code2WavRuntime, batch: int, frames: int, seed: int, device="cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, runtime.config.codebook_size, (batch, runtime.num_quantizers, frames),
                         generator=generator).to(device)


# ---------------------------------------------------------------- shape logic

def test_batch_buckets_are_every_size_up_to_eight_then_double_up_to_the_max_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert batch_buckets(6) == (1, 2, 3, 4, 5, 6)
    assert batch_buckets(12) == (1, 2, 3, 4, 5, 6, 7, 8, 12)
    assert batch_buckets(64) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
    assert batch_buckets(100) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 100)


def test_a_batch_goes_to_the_smallest_bucket_that_holds_it():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(buckets, b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket_for(buckets, 9) is None


def test_graph_key_pads_the_batch_never_the_frames():
    buckets = (1, 2, 4)
    assert graph_key(3, 4, buckets, max_frames=32) == (4, 4)
    assert graph_key(1, 32, buckets, max_frames=32) == (1, 32)
    assert graph_key(1, 33, buckets, max_frames=32) is None  # long call: eager
    assert graph_key(5, 4, buckets, max_frames=32) is None  # batch past the largest bucket: eager


def test_static_input_gets_the_rows_and_zero_padding():
    static = torch.full((4, 3, 5), 7, dtype=torch.long)
    codes = torch.arange(2 * 3 * 5).view(2, 3, 5)
    fill_padded(static, codes, static.shape[0])
    assert torch.equal(static[:2], codes)
    assert not static[2:].any()  # the previous call's codes do not linger in the padding rows
    full = torch.ones(4, 3, 5, dtype=torch.long)
    fill_padded(static, full, static.shape[0])
    assert torch.equal(static, full)


def test_output_rows_are_a_copy_of_the_calls_rows():
    static = torch.arange(12.0).view(4, 3)
    rows = output_rows(static, 3)
    static.zero_()  # the next replay
    assert torch.equal(rows, torch.arange(9.0).view(3, 3))


def test_settings_validate_and_a_stage_captures_its_first_chunk():
    with pytest.raises(ValueError, match="frames_at_start"):
        GraphSettings(max_frames=8, frames_at_start=(9,))
    with pytest.raises(ValueError, match=">= 1"):
        GraphSettings(max_batch=0)
    assert GraphSettings.for_stage(8, 4) == GraphSettings(8, DEFAULT_MAX_FRAMES, (4,))
    assert GraphSettings.for_stage(2, 40) == GraphSettings(2, 40, (40,))  # a long first chunk is still replayed
    assert GraphSettings.for_stage(8, 4, every_short_call=True, served=False).frames_at_start == ()
    with pytest.raises(ValueError, match="frame_buckets"):
        GraphSettings(max_frames=8, frames_at_start=(4,), frame_buckets=(2, 4))  # 5..8 would have no bucket
    with pytest.raises(ValueError, match="frame buckets"):
        GraphSettings(max_frames=8, frames_at_start=(3,), frame_buckets=(2, 4, 8))


def test_stream_frame_buckets_every_count_to_8_then_every_4th_and_the_ramp_exact():
    assert stream_frame_buckets(32) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32)
    assert stream_frame_buckets(32, (4, 8, 24, 25)) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 25, 28, 32)
    assert stream_frame_buckets(40, (40, 50)) == (*range(1, 9), 12, 16, 20, 24, 28, 32, 36, 40)
    assert stream_frame_buckets(6) == (1, 2, 3, 4, 5, 6)
    assert stream_frame_buckets(10) == (*range(1, 9), 10)


def test_stream_graphs_reach_a_chunk_size_past_the_default_bound():
    # --next-chunk-frames 50: the steady chunks replay a graph of their own length instead of running eagerly
    longer = GraphSettings.for_stream(8, (4, 8, 24, 50))
    assert longer.max_frames == 50 and longer.frame_buckets[-1] == 50 and 24 in longer.frame_buckets
    assert GraphSettings.for_stream(8, (4, 8, 24, 25)).max_frames == DEFAULT_MAX_FRAMES  # the default: unchanged


def test_graph_key_pads_stream_frames_up_to_their_bucket():
    buckets, frames = (1, 2, 4), stream_frame_buckets(32, (4, 8, 24, 25))
    assert graph_key(3, 9, buckets, 32, frames) == (4, 12)
    assert graph_key(1, 25, buckets, 32, frames) == (1, 25)  # the steady chunk: exact
    assert graph_key(1, 26, buckets, 32, frames) == (1, 28)
    assert graph_key(2, 5, buckets, 32, frames) == (2, 5)
    assert graph_key(1, 33, buckets, 32, frames) is None


def test_static_codes_get_the_call_in_the_corner_and_zeros_around():
    static = torch.full((4, 2, 6), 7, dtype=torch.long)
    codes = torch.arange(1, 2 * 2 * 4 + 1).view(2, 2, 4)
    fill_padded_frames(static, codes)
    assert torch.equal(static[:2, :, :4], codes)
    assert not static[:2, :, 4:].any() and not static[2:].any()  # neither padding frames nor rows linger


def test_a_frame_padded_calls_waveform_is_cut_to_its_own_frames():
    static = torch.arange(4 * 12.0).view(4, 12)  # 6 frames of 2 samples
    assert torch.equal(output_rows(static, 3, width=8), torch.arange(4 * 12.0).view(4, 12)[:3, :8])


def test_one_pass_graphs_refuse_frame_buckets():
    with pytest.raises(ValueError, match="one-pass"):
        Code2WavGraphs(lambda codes: codes, 16, torch.device("cpu"),
                       GraphSettings(max_frames=8, frames_at_start=(), frame_buckets=(4, 8)))


def test_ramp_sizes_are_one_streams_chunk_sizes():
    assert ChunkPolicy().ramp_sizes() == (4, 8, 24, 25)
    assert ChunkPolicy(6, 25).ramp_sizes() == (6, 12, 25)
    assert ChunkPolicy(1, 25).ramp_sizes() == (1, 2, 6, 18, 25)
    assert ChunkPolicy(30, 25).ramp_sizes() == (30, 25)
    assert ChunkPolicy(4, 4).ramp_sizes() == (4,)


def test_default_stateful_stage_captures_at_most_120_graphs_at_max_batch_8():
    """The served default (stateful streaming, warm start, --code2wav-max-batch 8): the stream chunks' 15 frame
    buckets x 8 batch sizes, no one-pass graph; before, both decodes' 32 frame counts: 512 captures."""
    stateful = ChunkPolicy.from_setting(4, 25, "stateful")
    graphs = stage_graph_settings(stateful, max_batch=8, warm_start=True)
    assert graphs["graph_settings"].captures_at_start == 0
    assert graphs["stream_graph_settings"].frames_at_start[0] == DEFAULT_MAX_FRAMES  # longest first: pool size
    assert capture_count(graphs) == 15 * 8 <= 120
    assert 2 * GraphSettings.for_stage(8, 4, every_short_call=True).captures_at_start == 512  # the old plan
    # without warm start: the first chunk's shapes only; a left-context stage: the one pass's, as before
    assert capture_count(stage_graph_settings(stateful, 8, warm_start=False)) == 8
    exact = stage_graph_settings(ChunkPolicy.from_setting(4, 25, "exact"), 8, warm_start=True)
    assert (exact["graph_settings"].captures_at_start, exact["stream_graph_settings"].captures_at_start) == (256, 0)


# ---------------------------------------------------------------- CPU: no-op

def test_cuda_graphs_change_nothing_on_the_cpu(tiny_checkpoint):
    with_graphs = Code2WavRuntime.create("torch", tiny_checkpoint, cuda_graphs=True)
    without = Code2WavRuntime.create("torch", tiny_checkpoint)
    assert with_graphs.graphs is None and without.graphs is None
    for batch, frames in ((1, 4), (3, 4), (2, 40)):
        codes = random_codes(without, batch, frames, seed=frames)
        expected = without.decode(codes)
        assert torch.equal(with_graphs.decode(codes), expected)
        with torch.inference_mode():
            assert torch.equal(expected, without.model(codes).float())


def test_stream_captures_of_one_batch_bucket_share_their_lengths_and_state_inputs(tiny_checkpoint):
    """Stream graphs' static inputs (what ``Code2WavGraphs._capture`` asks of the runtime): codes of the capture's
    own shape; lengths and state one set per batch bucket, reset for each capture (the shapes' lengths, a fresh
    stream's state). Built on the CPU here: the tensors, not the graphs."""
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint)
    first = runtime._stream_capture_inputs(2, 25)
    for static in first[2:]:
        static.fill_(7)  # as a replay leaves them
    second = runtime._stream_capture_inputs(2, 12)
    other_bucket = runtime._stream_capture_inputs(3, 12)
    assert first[0].shape == (2, runtime.num_quantizers, 25) and second[0].shape == (2, runtime.num_quantizers, 12)
    assert first[0].data_ptr() != second[0].data_ptr()
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first[1:], second[1:]))
    assert second[1].tolist() == [12, 12]
    fresh = runtime.streaming.initial_state(2)
    assert all(torch.equal(static, initial) for static, initial in zip(second[2:], fresh))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(second[1:], other_bucket[1:]))
    assert other_bucket[1].shape == (3,) and len(other_bucket) == len(second)


def test_cudnn_autotune_leaves_the_cpu_and_the_process_flag_alone_there(tiny_checkpoint):
    """On the CPU the switch changes nothing, not even torch's process-wide cuDNN flag (the CPU's other work
    stays on cuDNN's defaults)."""
    before = torch.backends.cudnn.benchmark
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, cudnn_autotune=True)
    assert torch.backends.cudnn.benchmark is before
    codes = random_codes(runtime, 2, 6, seed=3)
    with torch.inference_mode():
        assert torch.equal(runtime.decode(codes), runtime.model(codes).float())


def test_graphs_refuse_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA device"):
        Code2WavGraphs(lambda codes: codes, 16, torch.device("cpu"))


# ---------------------------------------------------------------- the switch reaches the stage

@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_code2wav_config_renders_the_switch_and_first_chunk(tiny_checkpoint, tmp_path, cuda_graphs):
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, cuda_graphs=cuda_graphs, first_chunk_frames=6)
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    settings = rendered_settings(out, "code2wav")
    assert settings.cuda_graphs is cuda_graphs
    assert settings.first_chunk_frames == 6


@pytest.mark.parametrize("flag, setting, expected", [
    ([], "code2wav_cudnn_autotune", False), (["--code2wav-cudnn-autotune", "on"], "code2wav_cudnn_autotune", True),
    ([], "code2wav_triton_snake", True), (["--code2wav-triton-snake", "off"], "code2wav_triton_snake", False)])
def test_the_code2wav_switch_flags_reach_the_code2wav_stage(tiny_checkpoint, tmp_path, flag, setting, expected):
    args = cli.build_parser().parse_args(["serve", *flag])
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, **{
        name: value for name, value in flag_settings(args).items() if name == setting})
    assert getattr(config, setting) is expected
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    assert getattr(rendered_settings(out, "code2wav"), setting) is expected


class _Metric:
    def set(self, value):
        pass

    def increment(self, value):
        pass


class _MetricFamily:
    GAUGE, COUNTER = "gauge", "counter"

    def __init__(self, *args, **kwargs):
        pass

    def Metric(self, *args, **kwargs):  # noqa: N802 (pb_utils' name)
        return _Metric()


def test_code2wav_model_passes_the_switch_to_its_runtime(tiny_checkpoint, tmp_path, monkeypatch):
    """The rendered model.py, run with a stand-in triton_python_backend_utils: what reaches Code2WavRuntime."""
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, cuda_graphs=True, first_chunk_frames=6,
                          code2wav_max_batch=5)
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    args = stage_args((out / "code2wav" / "config.pbtxt").read_text(), "code2wav")  # as Triton hands it over
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                        types.SimpleNamespace(MetricFamily=_MetricFamily))
    calls, create = [], Code2WavRuntime.create

    def recording_create(kind, checkpoint_dir, **kwargs):
        calls.append(kwargs)
        return create(kind, checkpoint_dir, **kwargs)

    monkeypatch.setattr(Code2WavRuntime, "create", staticmethod(recording_create))
    spec = importlib.util.spec_from_file_location("code2wav_model_under_test", out / "code2wav" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        model = module.TritonPythonModel()
        model.initialize(args)
    finally:
        torch.set_num_threads(threads)  # the stage caps torch's threads for its process
    (kwargs,) = calls
    assert kwargs["cuda_graphs"] is True
    # the defaults: the dilated phases and the fused SnakeBeta, not cuDNN's timed picks
    assert (kwargs["cudnn_autotune"], kwargs["dilated_phases"], kwargs["triton_snake"]) == (False, True, True)
    # the CPU default: stateful streaming, no warm start: the stream chunks' first chunk only
    assert kwargs["graph_settings"] == GraphSettings.for_stage(max_batch=5, first_chunk_frames=6, served=False)
    assert kwargs["stream_graph_settings"] == GraphSettings.for_stream(5, (6, 12, 25))
    assert model.vocoder.graphs is None  # on the CPU the switch changes nothing


# ---------------------------------------------------------------- GPU: replay == eager

FIRST_CHUNK, LAZY_FRAMES = 4, 12  # the first chunk, and the second chunk's call (8 new + 4 context frames)


@pytest.fixture(scope="module")
def gpu_runtime(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, device="cuda", cuda_graphs=True,
                                     graph_settings=GraphSettings(max_batch=4, max_frames=16,
                                                                  frames_at_start=(FIRST_CHUNK,)))
    # Out of the +-1 clamp, so equal outputs are not equal only because both saturate. In place: the graphs
    # read these same parameter tensors.
    calibrate_output_gain_(runtime.model)
    return runtime


def _eager_padded(runtime: Code2WavRuntime, codes: torch.Tensor, bucket: int) -> torch.Tensor:
    padded = torch.zeros(bucket, *codes.shape[1:], dtype=codes.dtype, device=codes.device)
    padded[:codes.shape[0]] = codes
    with torch.inference_mode():
        return runtime.model(padded).float()[:codes.shape[0]]


@cuda
def test_first_chunk_shapes_are_captured_at_start(gpu_runtime):
    assert {(b, FIRST_CHUNK) for b in (1, 2, 4)} <= gpu_runtime.graphs.captured_shapes


@cuda
@pytest.mark.parametrize("frames", [FIRST_CHUNK, LAZY_FRAMES])
@pytest.mark.parametrize("batch, bucket", [(1, 1), (3, 3)])  # every batch up to 8 is a bucket
def test_replay_equals_eager(gpu_runtime, batch, bucket, frames):
    codes = random_codes(gpu_runtime, batch, frames, seed=10 * batch + frames, device="cuda")
    replays = gpu_runtime.graphs.replays
    waveform = gpu_runtime.decode(codes)
    assert gpu_runtime.graphs.replays == replays + 1
    assert (bucket, frames) in gpu_runtime.graphs.captured_shapes
    assert waveform.shape == (batch, gpu_runtime.output_length(frames)) and waveform.dtype == torch.float32
    assert (waveform.abs() < 1.0).float().mean().item() > 0.9  # mostly not clamped: equality means something
    torch.testing.assert_close(waveform, _eager_padded(gpu_runtime, codes, bucket), rtol=0, atol=0)
    # Against the unpadded eager call: another shape, so cuDNN/cuBLAS may pick other kernels (TF32 convs by
    # default) and round differently; a padding row leaking into the real ones would be off by O(0.1).
    with torch.inference_mode():
        torch.testing.assert_close(waveform, gpu_runtime.model(codes).float(), rtol=0, atol=5e-3)


@cuda
def test_long_or_wide_calls_run_eagerly(gpu_runtime):
    replays = gpu_runtime.graphs.replays
    for batch, frames in ((1, 17), (5, FIRST_CHUNK)):
        codes = random_codes(gpu_runtime, batch, frames, seed=frames, device="cuda")
        with torch.inference_mode():
            expected = gpu_runtime.model(codes).float()
        torch.testing.assert_close(gpu_runtime.decode(codes), expected, rtol=0, atol=0)
    assert gpu_runtime.graphs.replays == replays


@cuda
def test_replays_from_several_threads_return_each_callers_rows(gpu_runtime):
    inputs = [random_codes(gpu_runtime, 1, FIRST_CHUNK, seed=100 + i, device="cuda") for i in range(4)]
    expected = [_eager_padded(gpu_runtime, codes, 1) for codes in inputs]
    mismatches, errors = [], []

    def decode_repeatedly(index: int) -> None:
        try:
            for _ in range(20):
                if not torch.equal(gpu_runtime.decode(inputs[index]), expected[index]):
                    mismatches.append(index)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=decode_repeatedly, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and not mismatches


@cuda
def test_stream_chunks_replay_and_equal_the_one_pass(gpu_runtime):
    """Stateful stream chunks (state in and out of the graph) replay graphs of their short shapes, first chunks
    captured at start; three streams, batched in their own bucket (3: every size up to 8 is one), equal the
    one-pass decode. Padding rows (lengths 0, above 8 rows) are checked on the CPU:
    test_code2wav_streaming.py::test_a_call_padded_to_its_frame_bucket_gives_the_calls_samples_and_state."""
    assert {(b, FIRST_CHUNK) for b in (1, 2, 4)} <= gpu_runtime.stream_graphs.captured_shapes
    codes = random_codes(gpu_runtime, 3, 4 + 8 + 12, seed=7, device="cuda")
    replays = gpu_runtime.stream_graphs.replays
    streamed = stream_ramp(gpu_runtime, codes, [FIRST_CHUNK, 8, 12])
    assert gpu_runtime.stream_graphs.replays == replays + 3
    assert_equals_one_pass(gpu_runtime, codes, streamed)


@pytest.fixture(scope="module")
def gpu_stateful_runtime(tiny_checkpoint):
    """A warm-started stateful stage's runtime (``stage_graph_settings``), batch buckets 1, 2, 3, 4."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    graphs = stage_graph_settings(ChunkPolicy.from_setting(4, 25, "stateful"), max_batch=4, warm_start=True)
    runtime = Code2WavRuntime.create("torch", tiny_checkpoint, device="cuda", cuda_graphs=True, **graphs)
    calibrate_output_gain_(runtime.model)
    return runtime


@cuda
def test_a_warm_stateful_stage_captures_every_stream_frame_bucket_and_no_one_pass_graph(gpu_stateful_runtime):
    frame_counts = gpu_stateful_runtime.stream_graphs.settings.frame_buckets
    assert len(frame_counts) == 15
    assert gpu_stateful_runtime.stream_graphs.captured_shapes == {(b, f) for b in (1, 2, 3, 4) for f in frame_counts}
    assert not gpu_stateful_runtime.graphs.captured_shapes


@cuda
def test_frame_padded_stream_chunks_replay_and_equal_the_one_pass(gpu_stateful_runtime):
    """Three ragged streams, calls of 5, 9, 13 and 25 frames (padded to 5, 12, 16, 25 frames and 4 rows): every
    call replays a graph captured at start (none captured lazily), and each stream equals the one pass."""
    from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates, StreamChunk

    runtime = gpu_stateful_runtime
    captured, replays = set(runtime.stream_graphs.captured_shapes), runtime.stream_graphs.replays
    states = Code2WavStreamStates(runtime.decode_stream, runtime.state_specs(), runtime.streaming_samples,
                                  runtime.device)
    calls = [[5, 4, 3], [9, 9, 7], [13, 11, 12], [25, 25, 20]]
    codes = random_codes(runtime, 3, 52, seed=21, device="cuda")
    pieces, done = [[], [], []], [0, 0, 0]
    for index, lengths in enumerate(calls):
        chunks = [StreamChunk(f"p{b}", codes[b, :, done[b]:done[b] + n], first=index == 0)
                  for b, n in enumerate(lengths)]
        for b, samples in enumerate(states.decode(chunks)):
            pieces[b].append(samples)
            done[b] += lengths[b]
    assert runtime.stream_graphs.replays == replays + len(calls)
    assert runtime.stream_graphs.captured_shapes == captured  # no request paid a capture
    for b in range(3):  # other shapes than one pass: cuDNN may round differently (TF32 convs)
        with torch.inference_mode():
            expected = runtime.model(codes[b:b + 1, :, :done[b]]).float()[0]
        torch.testing.assert_close(torch.cat(pieces[b]), expected, rtol=0, atol=5e-3)


def stage_streams_replay_the_one_pass(checkpoint, seed: int, next_chunk_frames: int = 25,
                                      **runtime_options) -> Code2WavRuntime:
    """A stateful stage's torch runtime on the GPU (max batch 2, no warm start, ``runtime_options`` on top: the
    switch under test) whose two streams of the 4, 8, 24, ``next_chunk_frames`` ramp replay a graph a chunk and equal
    the one pass (asserted here); the runtime, for the caller's own checks."""
    graphs = stage_graph_settings(ChunkPolicy.from_setting(4, next_chunk_frames, "stateful"), max_batch=2,
                                  warm_start=False)
    runtime = Code2WavRuntime.create("torch", checkpoint, device="cuda", cuda_graphs=True, **runtime_options,
                                     **graphs)
    calibrate_output_gain_(runtime.model)
    ramp = [4, 8, 24, next_chunk_frames]
    codes = random_codes(runtime, 2, sum(ramp), seed=seed, device="cuda")
    replays = runtime.stream_graphs.replays
    streamed = stream_ramp(runtime, codes, ramp)
    assert runtime.stream_graphs.replays == replays + len(ramp)
    assert_equals_one_pass(runtime, codes, streamed)
    return runtime


@cuda
def test_a_chunk_size_past_the_default_bound_replays_and_equals_the_one_pass(tiny_checkpoint):
    """``--next-chunk-frames 50``: the steady 50-frame chunks replay a graph of that length (captured on first
    use), not eager launches, and two streams equal the one pass."""
    runtime = stage_streams_replay_the_one_pass(tiny_checkpoint, seed=50, next_chunk_frames=50)
    assert (2, 50) in runtime.stream_graphs.captured_shapes


@cuda
def test_cudnn_autotuned_stream_chunks_replay_and_equal_the_one_pass(tiny_checkpoint):
    """``--code2wav-cudnn-autotune on``: cuDNN's timed algorithm picks, made in the warm-up calls
    before each capture, are what the graphs replay; two streams still equal the one pass. The process-wide flag is
    put back after (the other GPU tests run on cuDNN's heuristic)."""
    before = torch.backends.cudnn.benchmark
    try:
        stage_streams_replay_the_one_pass(tiny_checkpoint, seed=44, cudnn_autotune=True)
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
