"""Ask the orchestrator to drain before tritonserver is signalled to stop (why: ``omni_triton.shared.drain``)."""

from __future__ import annotations

import numpy as np

from omni_triton.launch.final_responses import RequestFailed, send_until_final
from omni_triton.shared.drain import DRAIN_S

# The drain is answered at most ABORTS_S (orchestrator) after its bound; past this much more it is given up on
ANSWER_MARGIN_S = 5.0


def drain_orchestrator(grpc_url: str, drain_s: float = DRAIN_S) -> str | None:
    """Send ``CONTROL="drain"`` to the orchestrator and wait for its answer: the streams in flight have ended.
    Returns None once drained, else why not (no server answering, an error, no answer in time): the stop goes on
    either way."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    control = grpcclient.InferInput("CONTROL", [1], "BYTES")
    control.set_data_from_numpy(np.array([b"drain"], dtype=np.object_))
    try:
        send_until_final(grpc_url, "orchestrator", [control], ["drain"], drain_s + ANSWER_MARGIN_S,
                         parameters={"drain_s": drain_s})
        return None
    except (RequestFailed, TimeoutError, InferenceServerException) as error:
        return str(error)
