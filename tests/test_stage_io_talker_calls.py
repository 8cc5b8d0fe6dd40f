"""The per-call paths in ``stage_io`` (a thinker chunk from a talker request; a talker or thinker response's tensors)
give what the plain torch calls give -- same values, dtypes, shapes, strides, devices, errors -- while skipping
the calls that change nothing (``benchmarks/stage_io_bench.py`` times both). Over the bench's stand-in of
pb_utils, on the CPU and, where there is one, the GPU (owned copies on ``InputStream``'s stream, codes sent as
tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from benchmark_scripts import load_script

from omni_triton.engine.handoff import InputStream
from omni_triton.pipeline.talker_service import TalkerOutput
from omni_triton.stages import stage_io

bench = load_script("stage_io_bench")
H = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def request_of(row_ids, embeds, hidden, prompt_len=0, finished=False):
    tensors = [bench.FakeTensor("START", np.zeros((1, 1), dtype=np.int32))]
    for name, value in (("ROW_IDS", row_ids), ("EMBEDS", embeds), ("HIDDEN", hidden)):
        if value is not None:
            tensors.append(bench.FakeTensor(name, value))
    tensors += [bench.FakeTensor("PROMPT_LEN", np.array([[prompt_len]], dtype=np.int32)),
                bench.FakeTensor("THINKER_FINISHED", np.array([[finished]], dtype=bool))]
    return bench.FakeRequest(tensors)


def plain_chunk(row_ids, embeds, hidden):
    """What the chunk's tensors are with every call made (reshape, .to), for comparison."""
    hidden_size = embeds.shape[-1]
    return row_ids.clone().reshape(-1).to(torch.long), embeds.clone().reshape(-1, hidden_size), \
        hidden.clone().reshape(-1, hidden_size)


def same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual.dtype, actual.shape, actual.stride(), actual.device) == \
        (expected.dtype, expected.shape, expected.stride(), expected.device)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("rows, hidden_rows, dtype, batch_dim", [
    (4, 0, torch.bfloat16, True), (4, 4, torch.float32, True), (1, 1, torch.bfloat16, True),
    (0, 0, torch.bfloat16, True), (3, 0, torch.float32, False)])
@pytest.mark.parametrize("device", DEVICES)
def test_a_talker_request_gives_the_chunk_of_plain_reshapes_in_memory_of_its_own(rows, hidden_rows, dtype, batch_dim,
                                                                                  device):
    row_ids = torch.arange(rows, dtype=torch.int64, device=device)
    embeds, hidden = torch.randn(rows, H, device=device).to(dtype), torch.randn(hidden_rows, H, device=device).to(dtype)
    if batch_dim:
        row_ids, embeds, hidden = row_ids[None], embeds[None], hidden[None]
    request = request_of(row_ids, embeds, hidden, prompt_len=hidden_rows, finished=True)
    chunk = stage_io.thinker_output_from_request(bench.fake_pb(), request, InputStream(torch.device(device)))
    for actual, expected, source in zip((chunk.row_ids, chunk.embeds, chunk.hidden),
                                        plain_chunk(row_ids, embeds, hidden), (row_ids, embeds, hidden)):
        same(actual, expected)
        assert actual.numel() == 0 or actual.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    same(chunk.token_ids, torch.zeros(0, dtype=torch.long))
    assert (chunk.prompt_len, chunk.finished) == (hidden_rows, True)


def test_int32_row_ids_become_int64_and_a_missing_input_is_the_same_error():
    request = request_of(torch.arange(3, dtype=torch.int32)[None], torch.zeros(1, 3, H), torch.zeros(1, 0, H))
    chunk = stage_io.thinker_output_from_request(bench.fake_pb(), request, InputStream(torch.device("cpu")))
    same(chunk.row_ids, torch.arange(3, dtype=torch.int64))
    missing = request_of(None, torch.zeros(1, 3, H), torch.zeros(1, 0, H))
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'to_dlpack'"):
        stage_io.thinker_output_from_request(bench.fake_pb(), missing, InputStream(torch.device("cpu")))


@pytest.mark.parametrize("codes", [torch.arange(32).reshape(2, 16), torch.arange(64, dtype=torch.int32).reshape(4, 16),
                                   torch.arange(64).reshape(4, 16)[1:], torch.arange(64).reshape(16, 4).t(),
                                   torch.zeros(0, 16, dtype=torch.int64)])
@pytest.mark.parametrize("device", DEVICES)
def test_a_talker_response_sends_its_codes_as_int64_with_a_batch_dim(codes, device):
    codes = codes.to(device)
    (tensor,) = stage_io.talker_output_tensors(bench.fake_pb(), TalkerOutput(codes, finished=False))
    sent = torch.utils.dlpack.from_dlpack(tensor.value)
    expected = codes.to(torch.int64).unsqueeze(0).contiguous()
    same(sent, expected if expected.numel() else expected.cpu())  # an empty tensor is sent from the host
    assert tensor.name() == "CODES"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_a_thinker_response_sends_its_ids_as_int64(id_dtype):
    from omni_triton.pipeline.thinker_service import ThinkerOutput
    out = ThinkerOutput(torch.arange(3, dtype=id_dtype), torch.arange(5, dtype=id_dtype), torch.zeros(5, H),
                        torch.zeros(0, H), prompt_len=0, finished=False)
    tensors = {tensor.name(): tensor for tensor in stage_io.thinker_output_tensors(bench.fake_pb(), out)}
    same(torch.utils.dlpack.from_dlpack(tensors["TOKEN_IDS"].value), torch.arange(3))
    same(torch.utils.dlpack.from_dlpack(tensors["ROW_IDS"].value), torch.arange(5))


class TorchInput(bench.FakeTensor):
    """A request input as the stub sees it, held in a torch tensor: on a GPU it has no host buffer."""

    def is_cpu(self) -> bool:
        return not self.value.is_cuda

    def as_numpy(self):
        return self.value.numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_host_arrays_read_ids_flags_and_lengths_with_their_dtypes(device):
    ids = TorchInput("TOKEN_IDS", torch.tensor([[5, 6, 7]], device=device))
    finished = TorchInput("FINISHED", torch.tensor([True], device=device))
    prompt_len = TorchInput("PROMPT_LEN", torch.tensor([108], dtype=torch.int32, device=device))
    read = stage_io.host_arrays(ids, finished, prompt_len)
    assert [array.tolist() for array in read] == [[[5, 6, 7]], [True], [108]]
    # an INT32 stays int32: the orchestrator sends the prompt length on to the talker as it read it
    assert [array.dtype for array in read] == [np.int64, np.bool_, np.int32]
    assert stage_io.host_array(prompt_len).tolist() == [108]
