"""A talker request is admitted without the engine's thread reading the device, and without Triton's thread
waiting for the engine steps queued on the default stream: the service builds the request's prefill on a stream
of its own and reads it to the host there for the prefix cache's keys (``InputStream.building``), the rope
positions are the engine's own, and a running request's appended rows are projected on the caller's thread.

The engine thread's other admission work reaches the device without a synchronising copy too: the thinker's prefill
ids and audio rows, a row's first sampling history (pinned memory, ``to_device_async``).

CPU: the service makes the keys the engine made itself, a second request with the same prompt reuses the first
one's blocks, and both give the same frames. GPU: the same; ``start`` and ``append`` return while a second of work
still runs on the default stream; and the engine's add and append, the thinker's prefill embedding and a history
slot run under CUDA's sync debug mode "error" (skipped without CUDA)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from tokenizers import Tokenizer

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.embed_rows import EmbedRows
from omni_triton.engine.handoff import InputStream
from omni_triton.engine.prefix_cache import embedding_keys
from omni_triton.engine.sampling import SampleRow, TokenHistory
from omni_triton.engine.sequence import Sequence
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_thinker
from omni_triton.pipeline.talker_inputs import TalkerInputs
from omni_triton.pipeline.talker_service import TalkerOutput, TalkerRequest, TalkerService
from omni_triton.pipeline.thinker_service import ThinkerOutput

PROMPT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
GENERATED = [11, 12, 13, 14, 15, 16]  # thinker tokens fed back: the first completes the prefill, the rest trail
FRAMES = 6
SPEAKER = "ethan"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
devices = [pytest.param("cpu"), pytest.param("cuda", marks=cuda)]


class Frames:
    """One request's frames as ``on_output`` delivers them, and when it finished."""

    def __init__(self):
        self.codes: list[torch.Tensor] = []
        self.done = threading.Event()
        self.error: str | None = None

    def __call__(self, output: TalkerOutput) -> None:
        self.codes.append(output.codes.cpu())
        if output.finished:
            self.error = output.error
            self.done.set()

    def all(self) -> torch.Tensor:
        assert self.done.wait(60), "the talker request never finished"
        assert self.error is None, self.error
        return torch.cat(self.codes)


@pytest.fixture(scope="module", params=devices)
def served(request, tiny_checkpoint):
    """(service, thinker chunks) on one device: the prompt's chunk (with the first generated row), then one
    appended chunk of the remaining rows, finished."""
    device = torch.device(request.param)
    service = TalkerService(tiny_checkpoint, EngineConfig(num_blocks=256, block_size=4, device=device.type,
                                                          kv_dtype=torch.float32, prefix_caching=True))
    config = OmniConfig.from_pretrained(tiny_checkpoint)
    thinker = load_thinker(tiny_checkpoint, device, with_audio=False)
    prompt = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).encode(PROMPT).ids
    ids = torch.tensor(prompt + GENERATED)
    with torch.inference_mode():
        embeds = thinker.embed(ids.to(device))
        hidden = torch.zeros(len(prompt), embeds.shape[1], device=device)  # a text prompt: no projected hidden rows
    p = len(prompt)
    first = ThinkerOutput(ids[p:p + 1], ids[:p + 1], embeds[:p + 1], hidden, p, False)
    rest = ThinkerOutput(ids[p + 1:], ids[p + 1:], embeds[p + 1:], hidden[:0], 0, True)
    yield service, (first, rest), config
    service.shutdown()


def _request(config: OmniConfig) -> TalkerRequest:
    return TalkerRequest(speaker_id=config.speaker_id[SPEAKER], greedy=True, repetition_penalty=1.0,
                         max_frames=FRAMES, min_frames=FRAMES, ignore_eos=True)


def _serve(served, request_id: str) -> torch.Tensor:
    service, (first, rest), config = served
    frames = Frames()
    service.start(request_id, _request(config), first, frames)
    service.append(request_id, rest)
    return frames.all()


def test_the_service_makes_the_engines_keys_and_a_repeated_prompt_reuses_its_blocks(served):
    service, chunks, config = served
    cache = service.engine.block_manager
    hits_before = cache.num_hit_tokens
    first = _serve(served, "first")
    second = _serve(served, "second")
    assert first.shape == (FRAMES, service.model.num_code_groups)
    assert torch.equal(first, second)
    assert cache.num_hit_tokens > hits_before, "the second request's prompt reused no block of the first's"

    # the keys the service made on its thread are the ones the engine's stage makes from the prefill itself
    p = chunks[0].prompt_len
    with torch.inference_mode():
        inputs = TalkerInputs(service.model, config, chunks[0].row_ids[:p].tolist(), SPEAKER,
                              service.tts_token_embeds)
        inputs.feed(chunks[0].row_ids[:p].to(service.device), chunks[0].embeds[:p], chunks[0].hidden)
        inputs.feed(chunks[0].row_ids[p:].to(service.device), chunks[0].embeds[p:])
        prefill, _ = inputs.take_prefill()
    keys = embedding_keys(prefill)
    seen = {}
    add = service.engine.add_request

    def recording(request_id, params, **inputs):
        seen[request_id] = inputs.get("prompt_keys")
        add(request_id, params, **inputs)

    service.engine.add_request = recording
    try:
        _serve(served, "third")
    finally:
        del service.engine.add_request
    assert (seen["third"] == keys).all()


@cuda
def test_start_and_append_return_while_the_default_stream_is_busy(served):
    service, (first, rest), config = served
    if service.device.type != "cuda":
        pytest.skip("the CPU has no streams")
    expected = _serve(served, "warm")  # kernels loaded, streams made
    frames = Frames()
    torch.cuda.synchronize()
    default = torch.cuda.current_stream(service.device)
    torch.cuda._sleep(2_000_000_000)  # engine steps queued on the default stream (about a second)
    service.start("busy", _request(config), first, frames)
    service.append("busy", rest)
    assert not default.query(), "start or append waited for the work queued on the default stream"
    assert torch.equal(frames.all(), expected)


def test_embed_rows_of_a_batch_read_as_its_rows_and_slice_it():
    batch, steps = torch.randn(5, 3), torch.randn(4, 3)
    rows = EmbedRows.of_batch(batch)
    whole = rows.tensor(1, 4)
    assert torch.equal(whole, batch[1:4]) and whole.data_ptr() == batch[1].data_ptr()  # a slice: no copy
    assert len(rows) == 5 and all(torch.equal(rows[i], batch[i]) for i in range(5))
    assert torch.equal(rows.tensor(0, 5), batch)  # rows read one by one since: stacked, the same values
    rows.append_row_of(steps, 2)
    rows.append(steps[0] + 1)
    mixed = rows.tensor(3, 7)  # prompt rows, a step's row, a pushed tensor: stacked
    assert torch.equal(mixed, torch.stack([batch[3], batch[4], steps[2], steps[0] + 1]))
    assert torch.equal(rows.tensor(5, 6), steps[2:3])


def test_building_hands_over_and_is_a_plain_block_on_the_cpu():
    with InputStream(torch.device("cpu")).building() as hand_over:
        made = torch.arange(3) * 2
        hand_over([made])
    assert made.tolist() == [0, 2, 4]


@cuda
def test_building_reads_what_it_made_without_waiting_for_the_default_stream(monkeypatch):
    device = torch.device("cuda")
    builder = InputStream(device)
    weight = torch.randn(64, 64, device=device)
    with builder.building():
        (weight @ weight).cpu()  # kernels loaded, the stream made
    torch.cuda.synchronize()
    marked = []
    record_stream = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda tensor, stream: (marked.append(stream), record_stream(tensor, stream)))
    default = torch.cuda.current_stream(device)
    torch.cuda._sleep(2_000_000_000)  # engine steps queued on the default stream
    with builder.building() as hand_over:
        made = weight @ weight
        hand_over([made])
        host = made.cpu()
    assert not default.query(), "the build waited for the default stream"
    assert marked == [default]  # the engine's stream may use what was built, its memory kept for it
    torch.cuda.synchronize()
    assert torch.allclose(host, (weight @ weight).cpu())


@contextlib.contextmanager
def no_device_sync():
    """CUDA's sync debug mode at "error" inside: any call that would wait for the device raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
def test_the_engine_applies_a_talker_add_and_append_without_waiting_for_the_device(served):
    """What the engine thread does with a talker request the service built: file it (its keys given, its
    positions the engine's own), and take a running request's rows projected already. Neither reads the device."""
    service, (first, rest), config = served
    if service.device.type != "cuda":
        pytest.skip("the CPU has no streams")
    # (no CUDA graphs: a capture here could meet the service's engine thread; what is tested comes before steps)
    engine = LLMEngine(TalkerStage(service.model), EngineConfig(num_blocks=64, block_size=4, device="cuda",
                                                                kv_dtype=torch.float32, prefix_caching=True,
                                                                cuda_graphs=False))
    p = first.prompt_len
    with torch.inference_mode():
        inputs = TalkerInputs(service.model, config, first.row_ids[:p].tolist(), SPEAKER, service.tts_token_embeds)
        inputs.feed(first.row_ids[:p].cuda(), first.embeds[:p], first.hidden)
        inputs.feed(first.row_ids[p:].cuda(), first.embeds[p:])
        prefill, _ = inputs.take_prefill()
        keys = embedding_keys(prefill)
        projected = service.model.project_text(rest.embeds)
        rows = (rest.row_ids.cuda(), rest.embeds, None)
        params = service.sampling_params(_request(config), prefill.shape[0])
        with no_device_sync():
            engine.add_request("r", params, prompt_embeds=prefill, talker_inputs=inputs, prompt_keys=keys)
            engine.append("r", thinker_rows=rows, projected_text=projected, finished=True)
    assert engine.requests["r"].cache_keys == keys.tobytes()


@cuda
def test_a_thinker_prefill_with_audio_rows_is_embedded_without_waiting_for_the_device(tiny_checkpoint):
    config = OmniConfig.from_pretrained(tiny_checkpoint)
    thinker = load_thinker(tiny_checkpoint, "cuda", with_audio=False)
    audio_id = config.thinker.audio_token_id
    stage = ThinkerStage(thinker, audio_token_id=audio_id)
    prompt = [5, 6, audio_id, audio_id, 7, audio_id, 8]
    seq = Sequence("a", SamplingParams(), num_prompt_positions=len(prompt), prompt_token_ids=prompt)
    audio = torch.randn(3, thinker.hidden_size, device="cuda")
    stage.init_sequence(seq, audio_embeds=audio)
    with torch.inference_mode():
        expected = stage.embed_inputs([(seq, 1, 6)])
        with no_device_sync():
            embeds = stage.embed_inputs([(seq, 1, 6)])
        assert torch.equal(embeds, expected)
        assert torch.equal(embeds[[1, 2, 4]], audio)  # prompt positions 2, 3 and 5


@cuda
def test_a_rows_first_sampling_history_is_filled_without_waiting_for_the_device():
    history = TokenHistory(4, 32, torch.device("cuda"))
    params = SamplingParams(stop_token_ids=(3,), suppressed_token_ids=(7, 9), min_new_tokens=2)
    row = SampleRow(params, None, seen_ids={1, 4, 30})
    with no_device_sync():
        slot = history.slot("r", row)
    assert history.seen[slot].nonzero().flatten().tolist() == [1, 4, 30]
    assert history.banned[slot, [3, 7, 9]].tolist() == [TokenHistory.UNDER_MIN, TokenHistory.ALWAYS,
                                                        TokenHistory.ALWAYS]
