"""The launcher's own requests (launch/final_responses.py: the first request, the drain): the stream is closed with
a cancel only when something is still running. With every final in, a cancel is not a no-op in Triton 2.51's gRPC
frontend (the drain test's stop once waited for the orchestrator to unload). The served paths are tested against
a real server in test_server_drain.py; this pins which close each outcome takes, with tritonclient's client
replaced by a recorder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tritonclient.grpc as grpcclient

from omni_triton.launch.final_responses import RequestFailed, send_until_final


class RecordingClient:
    """Answers each request at once (final, or an error) or never, and records how the stream was stopped."""
    stops: list = []

    def __init__(self, url, answer="final"):
        self.answer = answer

    def start_stream(self, callback):
        self.callback = callback

    def async_stream_infer(self, model, inputs, request_id, **kwargs):
        if self.answer == "final":
            final = SimpleNamespace(bool_param=True)
            result = SimpleNamespace(get_response=lambda: SimpleNamespace(parameters={"triton_final_response": final}))
            self.callback(result, None)
        elif self.answer == "error":
            self.callback(None, "model failed")

    def stop_stream(self, cancel_requests=False):
        RecordingClient.stops.append(cancel_requests)

    def close(self):
        pass


@pytest.mark.parametrize("answer, raised, cancelled", [
    ("final", None, False),  # every final in: the stream closes, nothing cancelled
    ("error", RequestFailed, True),
    ("never", TimeoutError, True),
])
def test_the_stream_is_cancelled_only_while_a_request_still_runs(monkeypatch, answer, raised, cancelled):
    RecordingClient.stops = []
    monkeypatch.setattr(grpcclient, "InferenceServerClient", lambda url: RecordingClient(url, answer))
    if raised is None:
        send_until_final("127.0.0.1:1", "orchestrator", [], ["a", "b"], timeout_s=0.2)
    else:
        with pytest.raises(raised):
            send_until_final("127.0.0.1:1", "orchestrator", [], ["a", "b"], timeout_s=0.2)
    assert RecordingClient.stops == [cancelled]
