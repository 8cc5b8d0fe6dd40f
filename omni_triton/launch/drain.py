"""Ask the orchestrator to drain before tritonserver is signalled to stop (why: ``omni_triton.shared.drain``)."""

from __future__ import annotations

import queue

import numpy as np

from omni_triton.shared.drain import DRAIN_S

# The drain is answered at most ABORTS_S (orchestrator) after its bound; past this much more it is given up on
ANSWER_MARGIN_S = 5.0


def drain_orchestrator(grpc_url: str, drain_s: float = DRAIN_S) -> str | None:
    """Send ``CONTROL="drain"`` to the orchestrator and wait for its answer: the streams in flight have ended.
    Returns None once drained, else why not (no server answering, an error, no answer in time): the stop goes on
    either way."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    answered: queue.Queue = queue.Queue()
    control = grpcclient.InferInput("CONTROL", [1], "BYTES")
    control.set_data_from_numpy(np.array([b"drain"], dtype=np.object_))
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answered.put(error))
        client.async_stream_infer("orchestrator", [control], request_id="drain", parameters={"drain_s": drain_s},
                                  enable_empty_final_response=True)
        error = answered.get(timeout=drain_s + ANSWER_MARGIN_S)
        return None if error is None else str(error)
    except queue.Empty:
        return f"no answer in {drain_s + ANSWER_MARGIN_S:.0f} s"
    except InferenceServerException as error:
        return str(error)
    finally:
        try:
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()
