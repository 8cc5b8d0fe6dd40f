"""Decoupled-model streams over gRPC on asyncio, built from Triton's protocol (``tritonclient.grpc``'s generated
``service_pb2`` modules) rather than through ``tritonclient.grpc.aio``'s ``stream_infer``.

Why: a decoupled model's stream says it is complete only in a final response, and when the model's last send is
a flag without outputs (the orchestrator's) that response exists only if the request asks for it with the
``triton_enable_empty_final_response`` parameter. The sync client has an argument for it; the aio client has
none, and newer tritonclient releases (2.73, the GPU image's; 2.50 still passes it) refuse any ``triton_``-prefixed
parameter passed through it ("is a reserved parameter"), raised inside the request iterator, which gRPC reports
as the call being cancelled. Building the request here sets the parameter on every tritonclient version.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, serialize_byte_tensor

MAX_MESSAGE_BYTES = 2**31 - 1  # what tritonclient's channels allow: audio inputs and outputs are large
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


def infer_request(model: str, arrays: dict[str, np.ndarray], request_id: str) -> service_pb2.ModelInferRequest:
    """One inference request of named arrays (object arrays as BYTES) that asks for the empty final response."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        if array.dtype == np.object_:
            serialized = serialize_byte_tensor(array)  # an object array holding one bytes object (or none)
            datatype, content = "BYTES", serialized.item() if serialized.size else b""
        else:
            datatype, content = np_to_triton_dtype(array.dtype), np.ascontiguousarray(array).tobytes()
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(content)
    request.parameters[EMPTY_FINAL_RESPONSE].bool_param = True
    return request


def is_final(result: InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class StreamChannel:
    """One gRPC channel to Triton; ``open`` starts a stream of one request (many at once on the event loop),
    ``ready`` asks for health."""

    def __init__(self, url: str):
        self.channel = grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                                                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    async def ready(self, model: str) -> bool:
        """Whether the server and ``model`` are ready; raises grpc.RpcError when the server does not answer."""
        server = await self.stub.ServerReady(service_pb2.ServerReadyRequest())
        return server.ready and (await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=model))).ready

    def open(self, request: service_pb2.ModelInferRequest, headers: dict[str, str] | None = None) -> "RequestStream":
        return RequestStream(self.stub, request, headers)

    async def close(self) -> None:
        await self.channel.close()


class RequestStream:
    """The responses of one request as ``(InferResult, None)`` or ``(None, InferenceServerException)``, like
    ``stream_infer``'s; ``cancel()`` cancels the gRPC call. The request side stays open until ``close()``: a stream
    closed by the client early would end the call before the model's last response."""

    def __init__(self, stub, request: service_pb2.ModelInferRequest, headers: dict[str, str] | None):
        self._sent_all = asyncio.Event()
        metadata = tuple((key.lower(), value) for key, value in (headers or {}).items())
        self.call = stub.ModelStreamInfer(self._requests(request), metadata=metadata)

    async def _requests(self, request):
        yield request
        await self._sent_all.wait()

    async def __aiter__(self) -> AsyncIterator[tuple[InferResult | None, InferenceServerException | None]]:
        async for response in self.call:
            if response.error_message:
                yield None, InferenceServerException(msg=response.error_message)
            else:
                yield InferResult(response.infer_response), None

    def close(self) -> None:
        self._sent_all.set()

    def cancel(self) -> None:
        self._sent_all.set()
        self.call.cancel()

