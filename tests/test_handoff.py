"""Step outputs handed to the response thread (engine/handoff.py): the outputs carry their sampled ids where the
step made them and the events their device tensors are complete after; merged outputs keep both; the response
thread's stream waits for those events and for nothing queued after them; request inputs are copied on a stream
of their own. CPU: the logic (no streams); GPU: the stream behaviour (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine_toy_model import ToyThinker
from omni_triton.engine import EngineConfig, EngineLoop, LLMEngine, SamplingParams, ThinkerStage
from omni_triton.engine.engine import RequestOutput, merge_outputs
from omni_triton.engine.handoff import (InputStream, OutputStream, complete_to_host, complete_to_host_all, ready_event,
                                       to_device_async)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_outputs_carry_their_sampled_ids_on_the_step_device():
    engine = LLMEngine(ThinkerStage(ToyThinker().eval(), accept_hidden_layer=2),
                       EngineConfig(block_size=4, num_blocks=64))
    engine.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=5), prompt_token_ids=[1, 2, 3])
    seen = []
    while engine.has_work():
        for output in engine.step():
            if output.new_token_ids:
                assert output.token_ids_device.tolist() == output.new_token_ids
                seen += output.new_token_ids
            assert output.ready_events == ()  # the CPU has no streams to wait on
    assert len(seen) == 5


def test_merged_outputs_keep_ids_and_events_in_order():
    first = RequestOutput("a", [4], token_ids_device=torch.tensor([4]), ready_events=("e1",))
    second = RequestOutput("a", [5, 6], token_ids_device=torch.tensor([5, 6]), ready_events=("e2",))
    other = RequestOutput("b", [9], token_ids_device=torch.tensor([9]), ready_events=("e2",))
    merged = merge_outputs([first, other, second])
    assert [m.request_id for m in merged] == ["a", "b"]
    assert merged[0].token_ids_device.tolist() == [4, 5, 6] == merged[0].new_token_ids
    assert merged[0].ready_events == ("e1", "e2")
    assert merged[1].ready_events == ("e2",)


def test_loop_delivers_ids_through_the_output_stream_on_cpu():
    engine = LLMEngine(ThinkerStage(ToyThinker().eval(), accept_hidden_layer=2),
                       EngineConfig(block_size=4, num_blocks=64))
    loop = EngineLoop(engine).start()
    try:
        stream = loop.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=6), prompt_token_ids=[3, 1])
        ids, device_ids = [], []
        for output in stream:
            ids += output.new_token_ids
            if output.token_ids_device is not None:
                device_ids += output.token_ids_device.tolist()
        assert ids == device_ids and len(ids) == 6
    finally:
        loop.shutdown()


def test_cpu_helpers_are_plain_copies():
    assert ready_event(torch.device("cpu")) is None
    x = torch.arange(4)
    (copy,) = InputStream(torch.device("cpu")).owned_copies([x])
    assert copy.data_ptr() != x.data_ptr() and copy.tolist() == x.tolist()
    assert to_device_async(x, torch.device("cpu")) is x
    with OutputStream(torch.device("cpu")).handling([None], [x]):
        assert (x + 1).tolist() == [1, 2, 3, 4]


@cuda
def test_output_stream_waits_for_the_step_event_and_not_for_later_steps():
    device = torch.device("cuda")
    step = torch.cuda.current_stream(device)
    handoff = OutputStream(device)
    out, result = torch.zeros(1024, device=device), torch.zeros(1024, device=device)
    with torch.cuda.stream(handoff.stream):
        torch.add(out, 1, out=result)  # the kernel loaded now: CUDA's lazy loading waits for the whole device
    torch.cuda.synchronize()  # (memory made, streams created and kernels loaded before the timed part)
    torch.cuda._sleep(50_000_000)  # the step's work: the output is written after a long kernel
    out.fill_(7)
    event = ready_event(device)
    torch.cuda._sleep(2_000_000_000)  # a later step queued behind it (about a second)
    with handoff.handling([event, event], [out]):
        torch.add(out, 1, out=result)
    handoff.stream.synchronize()
    assert not step.query()  # the later step is still running: the response did not wait for it
    assert torch.all(result == 8).item()
    step.synchronize()


@cuda
def test_output_stream_marks_each_storage_used_once(monkeypatch):
    """A step's outputs are row views of a few tensors (the talker's codes: one row per stream): the allocator tracks
    a storage, so one mark of it covers every view, and host tensors need none."""
    device = torch.device("cuda")
    marked, record_stream = [], torch.Tensor.record_stream

    def counted(tensor, stream):
        marked.append(tensor.untyped_storage().data_ptr())
        record_stream(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", counted)
    codes, ids = torch.zeros(4, 16, dtype=torch.long, device=device), torch.zeros(4, dtype=torch.long, device=device)
    with OutputStream(device).handling([], [*codes.split(1), *ids.split(1), torch.zeros(3)]):
        pass
    assert sorted(marked) == sorted([codes.data_ptr(), ids.data_ptr()])


@cuda
def test_a_complete_tensor_reaches_the_host_without_waiting_for_the_default_stream():
    device = torch.device("cuda")
    ids = torch.arange(16, device=device)
    complete_to_host(ids)  # its stream made and its copy loaded before the timed part
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # engine steps queued on the default stream (about a second)
    assert complete_to_host(ids).tolist() == list(range(16))
    assert not torch.cuda.current_stream(device).query()  # read while the queued steps still run
    torch.cuda.synchronize()


def test_complete_to_host_keeps_a_host_tensor():
    ids = torch.arange(4)
    assert complete_to_host(ids) is ids


@cuda
def test_several_complete_tensors_reach_the_host_in_one_wait_with_their_dtypes():
    device = torch.device("cuda")
    ids, flag, length = (torch.arange(5, device=device), torch.tensor([True], device=device),
                         torch.tensor([108], dtype=torch.int32, device=device))
    host = torch.tensor([7])
    complete_to_host_all([ids])  # its stream made before the timed part
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # engine steps queued on the default stream (about a second)
    read = complete_to_host_all([ids, host, flag, length])
    assert not torch.cuda.current_stream(device).query()  # read while the queued steps still run
    assert read[1] is host and all(not tensor.is_cuda for tensor in read)
    assert [t.tolist() for t in read] == [[0, 1, 2, 3, 4], [7], [True], [108]]
    assert [t.dtype for t in read] == [torch.int64, torch.int64, torch.bool, torch.int32]
    torch.cuda.synchronize()


def test_complete_to_host_all_keeps_host_tensors():
    tensors = [torch.arange(3), torch.tensor([True])]
    assert all(a is b for a, b in zip(complete_to_host_all(tensors), tensors))


@cuda
def test_input_copies_are_complete_without_waiting_for_the_default_stream():
    device = torch.device("cuda")
    source = torch.arange(1 << 20, device=device, dtype=torch.float32)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # engine steps queued on the default stream
    (copy,) = InputStream(device).owned_copies([source])
    assert not torch.cuda.current_stream(device).query()
    source.fill_(-1)  # the request's memory reused: the copy (done already) keeps the old values
    torch.cuda.synchronize()
    assert copy[-1].item() == (1 << 20) - 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_input_copies_from_another_gpu_land_on_the_stage_gpu_complete():
    """The split layout: the talker (GPU 1) gets the thinker's rows on GPU 0. A clone made them on GPU 0, on its
    current stream, which the copy stream's synchronize does not wait for: read at once, they were not written."""
    source = torch.arange(1 << 20, device="cuda:0", dtype=torch.int64)
    torch.cuda.synchronize("cuda:0")
    with torch.cuda.device(0):
        torch.cuda._sleep(200_000_000)  # work queued on GPU 0 before the copy (a clone there waits behind it)
    (copy,) = InputStream(torch.device("cuda:1")).owned_copies([source])
    assert copy.device == torch.device("cuda:1")
    assert complete_to_host(copy)[-3:].tolist() == [(1 << 20) - 3, (1 << 20) - 2, (1 << 20) - 1]
    torch.cuda.synchronize("cuda:0")


@cuda
def test_to_device_async_matches_a_plain_copy():
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert to_device_async(ids, torch.device("cuda")).cpu().tolist() == ids.tolist()


class _FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class InferenceResponse:
        def __init__(self, tensors=None, error=None):
            self.tensors, self.error = tensors, error

    class TritonError:
        def __init__(self, message):
            self.message = message


class _Sender:
    def __init__(self, fail: bool = False):
        self.sent, self.fail = [], fail

    def send(self, response=None, flags=0):
        if self.fail:
            raise RuntimeError("client gone")
        self.sent.append((response, flags))


def test_deferred_sends_answer_every_request_once_and_finally():
    from omni_triton.stages.deferred_sends import DeferredSends, PendingResponse

    sends = DeferredSends(_FakePb, torch.device("cpu"))
    good, broken, gone, after = _Sender(), _Sender(), _Sender(fail=True), _Sender()
    audio = torch.arange(3.0)

    def explode():
        raise ValueError("bad rows")

    sends.send_after(None, [audio], [PendingResponse(good, lambda: _FakePb.InferenceResponse([audio + 1])),
                                     PendingResponse(broken, explode),
                                     PendingResponse(gone, lambda: _FakePb.InferenceResponse([]))])
    sends.send_after(None, [], [PendingResponse(after, lambda: _FakePb.InferenceResponse(["later"]))])
    sends.close()
    (response, flags), = good.sent
    assert flags == 1 and response.tensors[0].tolist() == [1.0, 2.0, 3.0]
    (response, flags), = broken.sent
    assert flags == 1 and "ValueError: bad rows" in response.error.message
    assert after.sent[0][0].tensors == ["later"]  # a sender that raised did not stop the thread


def test_deferred_sends_send_a_final_flag_alone_in_order():
    # the talker's acknowledgement of a thinker chunk: no response, only the final flag, after what was queued first
    from omni_triton.stages.deferred_sends import DeferredSends, PendingResponse

    sends = DeferredSends(_FakePb, torch.device("cpu"))
    order = []

    class Recording(_Sender):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            order.append(self)

    first, gone, ack, taken, refused = Recording(), _Sender(fail=True), Recording(), Recording(), Recording()
    work = []
    sends.send_after(None, [], [PendingResponse(first, lambda: _FakePb.InferenceResponse(["frames"]))])
    sends.send_after(None, [], [PendingResponse(gone), PendingResponse(ack)])
    # work done on the sending thread before the flag (the talker's append): None when it went well, else the error
    sends.send_after(None, [], [PendingResponse(taken, lambda: work.append("rows") or None),
                                PendingResponse(refused, lambda: _FakePb.InferenceResponse(error="no such request"))])
    sends.close()
    assert ack.sent == [(None, 1)] and taken.sent == [(None, 1)]  # the flag alone: no response object
    assert work == ["rows"]
    (response, flags), = refused.sent
    assert flags == 1 and response.error == "no such request"
    assert order == [first, ack, taken, refused]
