"""Helpers for tests/test_reliability.py: gauge polling, raw gRPC streams, the stub processes a server starts, and
a client to kill.

Run as a script it is the "victim" client: it streams one long request, prints ``first-audio`` when the
first audio chunk arrives and then waits, so the test can SIGKILL it mid-stream:

    python tests/reliability_helpers.py GRPC_URL [DEADLINE_S]
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omni_triton.shared.procfs import PARENT, stat_fields

HELD_GAUGES = ("omni_active_requests", "omni_kv_blocks_used", "omni_pending_audio_frames")
# the victim's request: long enough (~4 s here) that it is still running well after its first audio
VICTIM_REQUEST = dict(max_tokens=60, max_audio_frames=400, min_audio_frames=400, ignore_eos=True, temperature=0.0)


def read_gauges(metrics_url: str) -> dict[tuple[str, str], float]:
    """omni_* gauges from the metrics port, keyed by (name, stage)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {(name, stage): float(value)
            for name, stage, value in re.findall(r'^(omni_\w+)\{stage="(\w+)"\} (\S+)$', text, re.M)}


def held_state(gauges: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """The gauges that say some stage still holds a request, KV blocks or audio frames."""
    return {key: value for key, value in gauges.items() if key[0] in HELD_GAUGES and value}


def seconds_until_idle(metrics_url: str, timeout_s: float, poll_s: float = 0.05, ignore_stage: str = "") -> float:
    """Poll the gauges until no stage (but ``ignore_stage``) holds anything; the seconds that took
    (AssertionError past timeout)."""
    start = time.monotonic()
    while True:
        gauges = read_gauges(metrics_url)
        held = {key: value for key, value in held_state(gauges).items() if key[1] != ignore_stage}
        if gauges and not held:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"stages still hold state after {timeout_s:.1f} s: {held}")
        time.sleep(poll_s)


@dataclass
class StreamOutcome:
    """How one raw stream ended: ``error`` is None for a completed stream."""

    error: str | None = None
    text: bytes = b""
    audio: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0


class StubStarts:
    """The Python-backend stub processes of ``model`` that the server ``server_pid`` starts while this watches (a
    look at /proc every ``every_s``): pid -> the name each was started with (its instance's, e.g. talker_0_0; the
    model's own for a stub that only auto-completes its config, which lives for seconds: its imports)."""

    def __init__(self, server_pid: int, model: str, every_s: float = 0.05):
        self.server_pid, self.model, self.every_s = server_pid, model, every_s
        self.started: dict[int, str] = {}
        self._before = set(self._stubs())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "StubStarts":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while True:
            self.started.update((pid, name) for pid, name in self._stubs().items() if pid not in self._before)
            if self._stop.wait(self.every_s):
                return

    def _stubs(self) -> dict[int, str]:
        found = {}
        for entry in Path("/proc").iterdir():
            fields = stat_fields(int(entry.name)) if entry.name.isdigit() else None
            if fields is None or int(fields[PARENT]) != self.server_pid:
                continue
            try:
                argv = [os.fsdecode(arg) for arg in (entry / "cmdline").read_bytes().split(b"\0")]
            except OSError:
                continue
            parts = Path(argv[1]).parts if len(argv) > 8 else ()
            if parts[-3:] and parts[-1] == "model.py" and parts[-3] == self.model:
                found[int(entry.name)] = argv[8]
        return found


def raw_stream(grpc_url: str, inputs: list, timeout_s: float, parameters: dict | None = None,
               model: str = "omni", streaming: threading.Event | None = None) -> StreamOutcome:
    """Send ready-made InferInputs on a stream of their own; gather it until FINAL or an error.

    Unlike OmniStreamClient this never raises for what the server answers (errors become the outcome);
    it raises TimeoutError when the server goes silent for ``timeout_s``, i.e. a hang. ``streaming`` is set once
    the first text has reached this client (a server's gauges count a request before its first response does).
    """
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    outcome, start = StreamOutcome(), time.monotonic()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer(model, inputs, request_id=f"raw-{time.monotonic_ns()}",
                                      parameters=parameters, enable_empty_final_response=True)
            while True:
                try:
                    result, error = responses.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"{model}: no response for {timeout_s} s") from None
                if error is not None:
                    outcome.error = error.message() if hasattr(error, "message") else str(error)
                    break
                text, audio = result.as_numpy("TEXT_DELTA"), result.as_numpy("AUDIO")
                if text is not None and text.size:
                    outcome.text += text.reshape(-1)[0]
                    if streaming is not None and outcome.text:
                        streaming.set()
                if audio is not None and audio.size:
                    outcome.audio.append(audio.reshape(-1))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            # cancel what is still in flight: a plain stop_stream() waits for every response, forever if a
            # request is stuck, and the test's own idle check is what must catch that
            client.stop_stream(cancel_requests=True)
    outcome.seconds = time.monotonic() - start
    return outcome


def victim_command(grpc_url: str, deadline_s: float | None = None) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), grpc_url]
    return command + ([str(deadline_s)] if deadline_s is not None else [])


def _victim(grpc_url: str, deadline_s: float | None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tritonclient.grpc as grpcclient

    from omni_triton.client import build_inputs

    announced = []

    def on_response(result, error) -> None:
        if error is not None:
            print(f"error {error}", flush=True)
        elif not announced and result.as_numpy("AUDIO") is not None and result.as_numpy("AUDIO").size:
            announced.append(True)
            print("first-audio", flush=True)

    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=on_response)
    parameters = None if deadline_s is None else {"deadline_s": deadline_s}
    client.async_stream_infer("omni", build_inputs("Tell me a very long story.", **VICTIM_REQUEST),
                              request_id="victim", parameters=parameters, enable_empty_final_response=True)
    time.sleep(300)  # the test kills this process long before


if __name__ == "__main__":
    _victim(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
