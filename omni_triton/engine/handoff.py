"""Step outputs handed from the engine's step thread to its response thread without waiting for later steps.

Every CUDA operation of a stage runs on one stream by default, and the step thread keeps it full: by the time
the response thread looks at a step's outputs, the next steps are already queued behind them. Anything the
response thread queued there (an embedding of the sampled ids, a dtype cast, a concatenation), and every wait
for it (Triton's DLPack export synchronises the stream current at the export, ``pb_tensor.cc``
``FromDLPack``), then waited for those later steps too: 4-9 ms a step under load, for every response.

So each step records an event right after the work that writes its outputs (``ready_event``), and the response
thread works on a stream of its own (``OutputStream``) that waits on those events alone. The allocator is told
that the step's output tensors are used on that stream (``record_stream``): their memory, freed by either
thread, is not given to the step stream again before the response thread's work on it is done.

On the CPU there are no streams: both are no-ops and the work runs in program order, as before.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch


def ready_event(device: torch.device) -> torch.cuda.Event | None:
    """An event on the current stream of ``device`` after the work queued so far (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class OutputStream:
    """The response thread's own stream: waits for the steps whose outputs it handles, and for nothing else."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def handling(self, events: Iterable[torch.cuda.Event | None],
                 tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """Inside: the current stream is this one, after ``events`` (each distinct one waited for once: events
        of steps whose output work was queued out of launch order come in any order), with ``tensors`` (made
        on the step stream) marked as used here (``mark_used_on``)."""
        if self.stream is None:
            yield
            return
        waited = set()
        for event in events:
            if event is not None and id(event) not in waited:
                waited.add(id(event))
                self.stream.wait_event(event)
        mark_used_on(tensors, self.stream)
        with torch.cuda.stream(self.stream):
            yield


class InputStream:
    """A stream for copies of request inputs that must be complete before the caller returns (Triton frees a
    request's input memory after ``execute``): waiting for this stream waits for those copies alone, not for
    the engine steps queued on the default stream. The copies are then used on the default stream, which the
    allocator is told (``record_stream``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def owned_copies(self, tensors: list[torch.Tensor],
                     check: Callable[..., None] | None = None) -> list[torch.Tensor]:
        """Copies of ``tensors`` on this stream's device, complete on return; ``check(*copies)`` (a validation
        that reads them on the host) runs on this stream too, so its read waits for the copies alone."""
        if self.stream is None:
            copies = [tensor.clone() for tensor in tensors]
            if check is not None:
                check(*copies)
            return copies
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            # onto this device, not a clone where the input lies: an input from another GPU (the split layout's
            # talker gets the thinker's rows from GPU 0) was cloned on that GPU's current stream, which this
            # stream's synchronize does not wait for, and read before the clone was written (the talker found no
            # assistant turn in half of its prompts under load)
            copies = [tensor.to(self.device, copy=True) for tensor in tensors]
            if check is not None:
                check(*copies)
        self.stream.synchronize()
        mark_used_on(copies, consumer)
        return copies

    @contextmanager
    def building(self) -> Iterator[Callable[[Iterable[torch.Tensor]], None]]:
        """Inside: what the calling thread queues runs on this stream, so a host read of what it makes waits for
        that work alone, not for the engine steps queued on the default stream (a talker request's prefill built
        on Triton's thread, and its prefix-cache keys read from it). Yields ``hand_over(tensors)``: tensors made
        inside that the stream current at entry (the engine's) uses later, marked used there. On a normal exit
        the stream is synchronised: what was built is complete before the engine can see it. Inputs must be
        complete already (owned copies, weights): this stream does not wait for the default one."""
        if self.stream is None:
            yield lambda tensors: None
            return
        consumer = torch.cuda.current_stream(self.device)
        handed: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            yield handed.extend
        self.stream.synchronize()
        mark_used_on(handed, consumer)


def mark_used_on(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """Tell the allocator that ``tensors`` (made on another stream) are used on ``stream``: their memory is not
    reused before the work queued there so far is done. Each distinct storage once, as the allocator marks a
    tensor's storage (a step's outputs are row views of a few tensors: at 64 streams, 64 marks of one storage)."""
    marked = set()  # storages, by their StorageImpl (``_cdata``: the tensors are all alive here)
    for tensor in tensors:
        if tensor.is_cuda:
            storage = tensor.untyped_storage()._cdata
            if storage not in marked:
                marked.add(storage)
                tensor.record_stream(stream)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (ids) on ``device`` without the host waiting for the stream: a copy from pageable
    memory blocks until the stream reaches it, behind every queued step; from pinned memory it does not (torch's
    pinned-memory cache keeps the buffer until the copy is done)."""
    if device.type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def complete_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A small tensor that is complete already (a request input Triton handed over, or a copy ``InputStream`` waited
    for) on the host, read on a stream of its own: read on the thread's current stream, the copy would wait for
    every engine step queued there first. Only for such tensors: one still being written by work queued on the
    current stream would be read before that work ran."""
    return complete_to_host_all([tensor])[0]


def complete_to_host_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``complete_to_host`` of several tensors in one wait: their copies queued together on the side stream, then
    one synchronise (a thinker chunk's ids, flag and prompt length: one wait for the three, not three). Host ones
    are returned as they are."""
    copies: dict[int, torch.Tensor] = {}
    streams = []
    for device in {tensor.device for tensor in tensors if tensor.is_cuda}:  # (a copy runs on its device's stream)
        stream = side_stream(device).stream
        with torch.cuda.stream(stream):
            # non_blocking: a device-to-host copy lands in pinned memory and returns; the synchronize waits for it
            copies.update({index: tensor.to("cpu", non_blocking=True) for index, tensor in enumerate(tensors)
                           if tensor.device == device})
        streams.append(stream)
    for stream in streams:
        stream.synchronize()
    return [copies.get(index, tensor) for index, tensor in enumerate(tensors)]


_side_streams: dict[torch.device, InputStream] = {}
_side_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> InputStream:
    """The process's one ``InputStream`` of ``device`` for work that must not wait for queued engine steps and
    is waited for where it is queued: ``complete_to_host``'s reads, a stage's owned copies of what another
    stage sent (``stage_io.owned_copy``). One per device, shared by every thread: each such piece of work is small
    and synchronised at once, so a thread waits for another's at most."""
    with _side_streams_lock:
        if device not in _side_streams:
            _side_streams[device] = InputStream(device)
        return _side_streams[device]
