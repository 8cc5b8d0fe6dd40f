"""Triton tensors <-> the stage services' types, shared by the thinker and talker model files.

Tensors cross between Triton and torch as DLPack views only, so on the GPU they stay on the GPU and
nothing depends on torch's numpy bridge (which breaks when the stub's numpy is not the one torch was
built against); numpy is used only for what Triton itself hands out as numpy (CPU inputs).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.utils.dlpack

from omni_triton.engine.handoff import InputStream, complete_to_host_all, side_stream
from omni_triton.pipeline.talker_service import TalkerOutput
from omni_triton.pipeline.thinker_service import ThinkerOutput
from omni_triton.shared import bundled_backend
from omni_triton.stages.collector import freeze_loaded_objects

THINKER_ROW_TENSORS = ("ROW_IDS", "EMBEDS", "HIDDEN", "PROMPT_LEN")

# Where this stub's outputs to other stages live: each stage is its own process, so this is per stage.
_host_only = False


def configure_interstage_memory(memory: str) -> None:
    """``device`` (default): tensors leave a stage where they are; ``host``: they are copied to host
    memory first (for Triton builds that cannot pass GPU tensors through decoupled BLS)."""
    global _host_only
    if memory not in ("device", "host"):
        raise ValueError(f"interstage_memory must be device or host, got {memory!r}")
    _host_only = memory == "host"


def device_tensors_between_stages() -> bool:
    return not _host_only


# What a deployer can change when a stage does not fit the GPU (omni-triton serve options).
MEMORY_OPTIONS = ("--kv-cache-tokens (or --gpu-memory-utilization with --kv-cache-tokens auto), "
                  "--dummy-layers N (fewer thinker/talker layers, with --load-format dummy), "
                  "--left-context-frames / --code2wav-max-batch (the vocoder's activations), or a larger GPU")


@contextmanager
def stage_loading(stage: str, freeze_collector: bool = False) -> Iterator[None]:
    """Around a stage's loading: a CUDA out-of-memory error becomes one that says which options make it fit. On
    a GPU, what loading freed goes back to the device (modules built in fp32 before their cast, the dummy
    embedding table the talker's rows come from: other stages' KV caches are planned on that memory), and the
    stage logs what it holds (the server log: to set against the launch's memory plan). ``freeze_collector``
    (``--stage-gc-freeze``): then the objects loading left are kept out of garbage collection (stages/collector.py)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        detail = str(error).split("\n")[0]
        raise RuntimeError(f"the {stage} stage ran out of GPU memory while loading ({detail}); "
                           f"make the pipeline fit with {MEMORY_OPTIONS}") from None
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        print(f"{stage}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated after loading (weights, KV "
              f"cache), GPU free {free / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    if freeze_collector:
        freeze_loaded_objects(stage)


def to_torch(tensor: Any) -> torch.Tensor:
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack())


def owned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A stage output (``to_torch`` of a BLS response's tensor) as a copy of this process's own, complete on
    return. Kept past its response, the view is not safe on the GPU: Triton's buffer goes back to its pool as soon
    as the last view is dropped -- at once, not after the GPU work queued to read it ran (torch's allocator does not
    know the buffer) -- so a kernel still queued behind other work (the orchestrator's concatenation of a stream's
    frames) could read what the pool put there next: codes that were another request's token ids, seen after a
    stage's reload slowed the GPU. The copy runs on a side stream (``handoff.side_stream``) and is waited for alone."""
    if not tensor.is_cuda:
        return tensor  # on the host the work that reads it runs when it is called, not later
    return side_stream(tensor.device).owned_copies([tensor])[0]


def from_torch(pb: Any, name: str, tensor: torch.Tensor) -> Any:
    if _host_only:
        tensor = tensor.cpu()
    if tensor.numel() == 0:
        tensor = tensor.cpu()  # an empty GPU tensor has no device buffer to hand over
    elif tensor.storage_offset() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)  # DLPack consumers may ignore offsets
    if tensor.is_cuda:
        # The tensor itself, not a capsule: the backend then asks for it through __dlpack__(stream) and waits
        # for the kernels that write it. A capsule is taken as is, so the next stage could read the buffer
        # before the producing kernels finished (served audio differed from the in-process pipeline's).
        return pb.Tensor.from_dlpack(name, tensor)
    return pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(tensor))


def as_int64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to(torch.int64)``, without the call where it would return ``tensor`` itself: once per response or
    request, the no-op's dispatch costs about as much host time as a view."""
    return tensor if tensor.dtype is torch.int64 else tensor.to(torch.int64)


def concat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several stage outputs as one tensor, on the device of the non-empty ones: ``from_torch`` sends an
    empty tensor from host memory (a GPU tensor of no elements has no buffer to hand over), so a stage's empty
    rows (a finishing chunk's, the prompt-only hidden states) arrive on the host beside GPU rows."""
    rows = [tensor for tensor in tensors if tensor.numel()]
    return torch.cat(rows) if rows else tensors[-1]


def host_array(tensor: Any) -> np.ndarray:
    """A small tensor (ids, flags, scalars) on the host. One on a GPU (a stage's host output that the orchestrator
    asked for on its GPU) is read on a stream of its own: on the thread's current stream the read would wait for
    every engine step queued there first. The input is complete when Triton hands it over."""
    return host_arrays(tensor)[0]


def host_arrays(*tensors: Any) -> list[np.ndarray]:
    """``host_array`` of several tensors, those on a GPU read in one wait (``complete_to_host_all``), with their
    dtypes (an INT32 stays int32: it may be sent on as it is)."""
    on_gpu = [index for index, tensor in enumerate(tensors) if not tensor.is_cpu()]
    read = iter(complete_to_host_all([to_torch(tensors[index]) for index in on_gpu]))
    return [np.asarray(next(read).numpy()) if index in on_gpu else tensor.as_numpy()
            for index, tensor in enumerate(tensors)]


def request_inputs(request: Any) -> dict[str, Any]:
    """A request's input tensors by name, in one pass: ``pb_utils.get_input_tensor_by_name`` lists the inputs and
    scans them again for every name it is asked. Names are unique in a request; ``.get`` gives None for an absent
    one, as that does."""
    return {tensor.name(): tensor for tensor in request.inputs()}


def input_arrays(pb: Any, request: Any, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Small scalar inputs of a request, on the host; absent optional inputs are left out."""
    arrays = {}
    for name in names:
        tensor = pb.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = host_array(tensor)
    return arrays


def answer_abort(pb: Any, request: Any, sender: Any, abort: Callable[[str], None], request_id: str) -> bool:
    """If ``request`` is an abort control request (CONTROL="abort"), drop ``request_id`` through ``abort`` and
    close the control request; whether it was one. Thinker and talker take aborts the same way."""
    if control_word(pb, request) != "abort":
        return False
    abort(request_id)
    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return True


def control_word(pb: Any, request: Any) -> str | None:
    tensor = pb.get_input_tensor_by_name(request, "CONTROL")
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    return value[0].decode() if len(value) and isinstance(value[0], bytes) else str(value[0]) if len(value) else None


def thinker_output_tensors(pb: Any, out: ThinkerOutput) -> list[Any]:
    return [
        from_torch(pb, "TOKEN_IDS", as_int64(out.token_ids)),
        from_torch(pb, "ROW_IDS", as_int64(out.row_ids)),
        from_torch(pb, "EMBEDS", out.embeds),
        from_torch(pb, "HIDDEN", out.hidden),
        pb.Tensor("PROMPT_LEN", np.array([out.prompt_len], dtype=np.int32)),
        pb.Tensor("FINISHED", np.array([out.finished], dtype=bool)),
    ]


# A talker request's text ids: none (the talker reads rows). One tensor for every request: it has no elements, so
# nothing can write to it, and consumers only read it (``merge_appends`` concatenates).
_NO_TOKEN_IDS = torch.zeros(0, dtype=torch.long)


def thinker_output_from_request(pb: Any, request: Any, inputs: InputStream,
                                tensors: dict[str, Any] | None = None) -> ThinkerOutput:
    """The thinker chunk a talker request carries (batch dim of the sequence batcher dropped), in memory of
    its own: the talker keeps the rows until its engine steps have used them, while Triton frees a request's
    input memory, and may hand it to another request, once the request is done. On a GPU the copies are kernels
    on ``inputs``' stream, waited for before this returns (never the talker's steps queued on its own stream:
    otherwise the talker read other requests' rows, served audio differing from the in-process pipeline's).
    ``tensors``: ``request_inputs(request)``, where the caller has it already."""
    if tensors is None:
        tensors = request_inputs(request)
    row_ids, embeds, hidden = inputs.owned_copies([to_torch(tensors.get(name))
                                                   for name in ("ROW_IDS", "EMBEDS", "HIDDEN")])
    hidden_size = embeds.shape[-1]
    row_ids = _without_batch_dim(row_ids, -1)
    return ThinkerOutput(
        token_ids=_NO_TOKEN_IDS,
        row_ids=as_int64(row_ids),  # ROW_IDS is INT64: the owned copy itself (complete)
        embeds=_without_batch_dim(embeds, -1, hidden_size),
        hidden=_without_batch_dim(hidden, -1, hidden_size),
        prompt_len=int(host_array(tensors.get("PROMPT_LEN")).reshape(-1)[0]),
        finished=bool(host_array(tensors.get("THINKER_FINISHED")).reshape(-1)[0]),
    )


def _without_batch_dim(tensor: torch.Tensor, *shape: int) -> torch.Tensor:
    """``tensor.reshape(shape)`` (``shape``: -1 and the trailing dims); for the usual ``[1, ...]`` contiguous input,
    the same view taken as ``tensor[0]``, which costs half as much host time as a reshape."""
    if tensor.dim() == len(shape) + 1 and tensor.shape[0] == 1 and tensor.shape[2:] == shape[1:] \
            and tensor.is_contiguous():
        return tensor[0]
    return tensor.reshape(shape)


def talker_output_tensors(pb: Any, out: TalkerOutput) -> list[Any]:
    return [from_torch(pb, "CODES", as_int64(out.codes).unsqueeze(0))]  # [1, n, G]: batch dim


def send_output(pb: Any, sender: Any, out: ThinkerOutput | TalkerOutput, tensors: Any) -> None:
    """Stream one stage output: its tensors (``tensors(pb, out)``) or its error; FINAL once it is finished."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
    if out.error is not None:
        sender.send(pb.InferenceResponse(error=pb.TritonError(out.error, pb.TritonError.INTERNAL)), flags=flags)
    else:
        sender.send(pb.InferenceResponse(tensors(pb, out)), flags=flags)


def bls_stream(request: Any) -> Iterator[Any]:
    """Send a decoupled BLS ``request`` now (``exec`` returns once the stage accepted it: a talker START must reach
    the stage before its appends) and iterate its responses, the iterator released however the reading ends."""
    iterator = request.exec(decoupled=True)

    def responses() -> Iterator[Any]:
        try:
            yield from iterator
        finally:
            bundled_backend.release_iterator(iterator)

    return responses()


def request_self(pb: Any, model: str, inputs: list[Any], **kwargs: Any) -> None:
    """Send this stage's own model ``model`` a request and wait for its answers (raises on an error answer). A
    request whose caller died is ended this way (``callers``): through Triton, like the caller's own end, so it
    runs in turn with the stage's other requests and frees what Triton holds for it too."""
    request = pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=[], **kwargs)
    for response in bls_stream(request):
        if response.has_error():
            raise RuntimeError(response.error().message())


class OrphanSequences:
    """The talker's sequences (request id -> correlation id) while they run, and the END that closes one whose
    caller died: the abort the orchestrator sends to end a sequence (``BlsStageClients``), sent by the stage to
    itself, so that Triton's sequence batcher frees the sequence's slot too (else it holds it for
    ``max_sequence_idle_microseconds``) and routes the abort to the instance that holds it."""

    def __init__(self, pb: Any, model: str):
        self._pb, self._model = pb, model
        self._correlation_ids: dict[str, int] = {}

    def started(self, request_id: str, correlation_id: int) -> None:
        self._correlation_ids[request_id] = correlation_id

    def forget(self, request_id: str) -> None:
        self._correlation_ids.pop(request_id, None)

    def end(self, request_id: str) -> None:
        correlation_id = self._correlation_ids.pop(request_id, None)
        if correlation_id is None:  # ended already (its frames stream finished, or an earlier drop)
            return
        control = self._pb.Tensor("CONTROL", np.array([[b"abort"]], dtype=np.object_))  # batch dim: sequence-batched
        request_self(self._pb, self._model, [control], request_id=request_id, correlation_id=correlation_id,
                     flags=self._pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
