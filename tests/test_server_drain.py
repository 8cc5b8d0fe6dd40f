"""A stop with a stream in flight drains first: the launcher asks the orchestrator to end its streams while the server
still takes their stage calls, so the stream ends with UNAVAILABLE naming the shutdown and tritonserver exits without
waiting out its exit timeout for requests left in the stages."""

from __future__ import annotations

import re
import subprocess
import threading

import pytest

from omni_triton.client import OmniStreamClient, StreamError
from omni_triton.launch.repository import render_repository
from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port
from omni_triton.shared.drain import DRAIN_S, SHUTTING_DOWN, control_word, drain_seconds
from omni_triton.shared.settings import STAGES, LaunchConfig
from server_fixture import servable_models


UNLOAD_ROOM_S = 30  # the drain test's exit timeout (serve's is 10 s): see the test


def test_control_words_are_cancel_and_drain_and_anything_else_names_control():
    assert control_word(b"cancel") == "cancel" and control_word(b"drain") == "drain"
    for word in (b"abort", b"", b"Drain", b"\xff"):
        with pytest.raises(ValueError, match="CONTROL must be one of"):
            control_word(word)


def test_drain_seconds_default_to_the_setting_and_refuse_what_is_not_seconds():
    assert drain_seconds(None) == drain_seconds("{}") == DRAIN_S
    assert drain_seconds('{"drain_s": 0}') == 0.0 and drain_seconds('{"drain_s": 1.5}') == 1.5
    for value in ('-1', 'true', '"5"', 'Infinity'):
        with pytest.raises(ValueError, match="drain_s"):
            drain_seconds(f'{{"drain_s": {value}}}')


@pytest.mark.server
def test_a_stop_drains_the_stream_in_flight_and_exits_without_the_exit_timeout(tiny_checkpoint, tmp_path):
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          max_audio_frames_cap=4096)
    repository = render_repository(config, tmp_path / "repository", servable_models())
    # a short drain: the stream below runs far longer, so it is the bound that ends it (cancelled by the drain).
    # tritonserver's exit timeout bounds two waits: for the requests in flight (what the drain empties: asserted
    # below from its own count at the stop), then for the models to unload, which on a loaded 2-core runner took
    # past 10 s (six Python stubs finalising beside other servers' tests; the in-flight count 0 at once): room
    # for the second, so that an expiry here still means the stop waited on something
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), drain_s=0.5,
                            exit_timeout_s=UNLOAD_ROOM_S)
    server = TritonServer(repository, find_tritonserver(), options, log_path=tmp_path / "tritonserver.log").start()
    playing, ended = threading.Event(), {}

    def long_stream() -> None:
        with OmniStreamClient(server.grpc_url) as client:
            try:
                # 4 minutes of audio: still streaming when the drain's bound passes, however fast the machine
                client.stream("a long answer", timeout_s=60, temperature=0.0, max_tokens=20, ignore_eos=True,
                              max_audio_frames=3000, min_audio_frames=3000, on_audio=lambda audio: playing.set())
                ended["error"] = None
            except StreamError as error:
                ended["error"] = error
            finally:
                playing.set()  # an early end is told by ``ended``

    try:
        server.wait_ready(timeout_s=180)
        streaming = threading.Thread(target=long_stream)
        streaming.start()
        assert playing.wait(60), "the stream sent no audio"
        assert not ended, f"the stream ended before the stop: {ended}"
    finally:
        server.stop(timeout_s=UNLOAD_ROOM_S + 10)
    streaming.join(30)

    error = ended.get("error")
    assert error is not None, "the stream ended normally"
    assert error.code == "UNAVAILABLE" and SHUTTING_DOWN in error.message(), str(error)
    assert server.drain_outcome is None, f"the drain failed: {server.drain_outcome}"
    log = server.log_path.read_text(errors="replace")
    # (an unload past its wait had the stubs still alive write their stacks to the log: its tail says where)
    assert server.stop_outcome == "graceful", log[-6000:]
    # nothing left in a stage once the drain answered: Triton's first look finds no request in flight (a stop that
    # did not drain counts the talker's down to the exit timeout: "Model 'talker' has 2 in-flight inferences")
    in_flight = re.findall(r"Found (\d+) model versions that have in-flight inferences", log)
    assert in_flight and set(in_flight) == {"0"}, log[-3000:]
    assert not re.search(r"has \d+ in-flight inferences", log) and "Exit timeout expired" not in log, log[-3000:]
    leftover = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub.*{server.shm_prefix}"],
                              capture_output=True, text=True).stdout.split()
    assert not leftover, f"stub processes left: {leftover}"
