"""The Python backend built from source (``omni-triton build python-backend``): chosen, clean, and what CI runs.

CI (and the README's test command) builds it in scripts/setup.sh, so the whole suite runs on it; the
bundled backend keeps its own module (test_bundled_backend.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from build_engines import python_backend as builder
from omni_triton.client import OmniStreamClient
from omni_triton.shared import bundled_backend
from omni_triton.launch.python_backend import BACKEND_FILES, BUILD_INFO, load_built_backend
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.launch.tritonserver import TritonServerError, find_tritonserver

THIRD_PARTY = Path(__file__).resolve().parents[2] / "shared" / "third_party"
SHUTDOWN_ALARMS = ("Fatal Python error", "Segmentation fault", "Exit timeout expired", "Aborted")


def _fake_build(directory: Path, **info) -> Path:
    python_dir = directory / "python"
    python_dir.mkdir(parents=True)
    for name in BACKEND_FILES:
        (python_dir / name).write_text("")
    (python_dir / BUILD_INFO).write_text(json.dumps(info))
    return directory


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI must run on the built backend; elsewhere optional")
def test_ci_serves_every_test_with_the_built_backend():
    built, why_not = load_built_backend()
    assert built is not None, why_not
    install = find_tritonserver()
    assert install.python_backend == "built" and install.backend_dir == built.directory


def test_an_unusable_build_is_named_with_the_reason(tmp_path, monkeypatch):
    built, why_not = load_built_backend(tmp_path / "nothing")
    assert built is None and "missing libtriton_python.so" in why_not
    other_python = _fake_build(tmp_path / "py27", python="2.7", gpu=False)
    built, why_not = load_built_backend(other_python)
    assert built is None and "built for Python 2.7" in why_not and "omni-triton build python-backend" in why_not
    monkeypatch.setenv("OMNI_TRITON_PYTHON_BACKEND_DIR", str(tmp_path / "nothing"))
    with pytest.raises(TritonServerError, match="--python-backend built: no built Python backend"):
        find_tritonserver(python_backend="built")
    assert find_tritonserver(python_backend="auto").python_backend == "bundled"


def test_a_cpu_only_build_is_not_chosen_for_cuda(tmp_path, monkeypatch):
    import sys

    cpu_build = _fake_build(tmp_path / "cpu", python=f"{sys.version_info.major}.{sys.version_info.minor}", gpu=False)
    monkeypatch.setenv("OMNI_TRITON_PYTHON_BACKEND_DIR", str(cpu_build))
    assert find_tritonserver(device="cpu").python_backend == "built"
    install = find_tritonserver(device="cuda")
    assert install.python_backend == "bundled" and "rebuild with --gpu" in install.python_backend_note


def test_a_matching_build_is_not_repeated(tmp_path):
    wanted = builder.wanted_info(gpu=False, build_type="Release")
    assert not builder.up_to_date(tmp_path, wanted)
    _fake_build(tmp_path, **wanted)
    assert builder.up_to_date(tmp_path, wanted)
    assert not builder.up_to_date(tmp_path, builder.wanted_info(gpu=True, build_type="Release"))


def test_missing_tools_are_named_with_where_they_come_from(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.setattr(builder.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(builder.BuildError, match=r"cmake >= 3\.31\.8 is needed .*pip install 'cmake>=3\.31\.8'"):
        builder.find_cmake()
    with pytest.raises(builder.BuildError, match="no C\\+\\+ compiler"):
        builder.find_compiler()


@pytest.mark.skipif(not THIRD_PARTY.is_dir(), reason="the pinned source tarballs are not beside this checkout")
def test_our_patches_apply_to_the_pinned_sources(tmp_path):
    src = builder.fetch_sources(THIRD_PARTY, tmp_path)
    patched = (src / "python_backend" / "src" / "pb_response_iterator.cc").read_text()
    assert "give the GIL up before taking mu_" in patched
    # python_backend-dead-stub-requests.patch, applied after it and before the ones that touch other files
    assert "ModelInstanceState::StubExited()" in (src / "python_backend" / "src" / "python_be.cc").read_text()
    assert "TRITON_COMMON_ENABLE_TESTS" in (src / "common" / "src" / "CMakeLists.txt").read_text()
    assert "TRITONSERVER_InferenceRequestSetPriorityUInt64" in (
        src / "python_backend" / "src" / "request_executor.cc").read_text()  # python_backend-bls-priority.patch
    metric = (src / "python_backend" / "src" / "metric.cc").read_text()  # python_backend-metric-set-without-gil.patch
    set_value = metric[metric.index("Metric::SendSetValueRequest"):metric.index("Metric::SendObserveRequest")]
    assert "py::gil_scoped_release release;" in set_value
    stub = (src / "python_backend" / "src" / "pb_stub.cc").read_text()  # python_backend-execute-handback-without-gil
    handbacks = stub[stub.index("Stub::ProcessRequests("):stub.index("py::object execute_return;")]
    assert handbacks.count("py::gil_scoped_release release;") == 2


# A model whose one instance serves its queue by priority (two levels, the second the default) and answers each
# request with the order in which it was executed; its first request (TAG 0) holds the instance for a while.
_SINK_CONFIG = """
name: "sink"
backend: "python"
max_batch_size: 1
input [ { name: "TAG" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ORDER" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { priority_levels: 2 default_priority_level: 2 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
_SINK = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.executed = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            tag = int(pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy().reshape(-1)[0])
            if tag == 0:
                time.sleep(HOLD_S)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ORDER", np.array([[self.executed]], dtype=np.int32))]))
            self.executed += 1
        return responses
"""
# A BLS model that calls the sink: the holding request, then (while it holds) three requests at the default
# priority and last one with the BLS parameter "priority": 1; it answers the sink's execution order by TAG.
_CALLER_CONFIG = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "GO" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ORDER" data_type: TYPE_INT32 dims: [ 5 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
_CALLER = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        order = [None] * 5

        def call(tag, parameters):
            request = pb_utils.InferenceRequest(
                model_name="sink", requested_output_names=["ORDER"], parameters=parameters,
                inputs=[pb_utils.Tensor("TAG", np.array([[tag]], dtype=np.int32))])
            response = request.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            order[tag] = int(pb_utils.get_output_tensor_by_name(response, "ORDER").as_numpy().reshape(-1)[0])

        threads = []
        for tag in range(5):
            thread = threading.Thread(target=call, args=(tag, {"priority": 1} if tag == 4 else {}))
            thread.start()
            threads.append(thread)
            time.sleep(GAP_S)  # each request queued before the next is made
        for thread in threads:
            thread.join()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("ORDER", np.array(order, dtype=np.int32))])
                for _ in requests]
"""


@pytest.mark.server
def test_a_bls_request_with_priority_1_is_served_before_the_queued_default_ones(tmp_path):
    """python_backend-bls-priority.patch: the sink executes the holding request first, then the one sent last with
    priority 1, then the three it found queued at the default level, in their order. Unpatched, the BLS
    parameter is only a parameter: the priority-1 request ran last (order 4)."""
    built, why_not = load_built_backend()
    if built is None:
        pytest.skip(why_not)
    import numpy as np
    import tritonclient.grpc as grpcclient

    from omni_triton.launch.tritonserver import ServerOptions, TritonServer, free_port

    hold_s, gap_s = 3.0, 0.3  # the four later requests are all queued within 1.2 s of a 3-s hold
    repository = tmp_path / "repository"
    for name, config, source in (("sink", _SINK_CONFIG, _SINK.replace("HOLD_S", str(hold_s))),
                                 ("caller", _CALLER_CONFIG, _CALLER.replace("GAP_S", str(gap_s)))):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
        (repository / name / "1" / "model.py").write_text(source)
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(repository, find_tritonserver(python_backend="built"), options,
                          log_path=tmp_path / "tritonserver.log").start()
    try:
        server.wait_ready(timeout_s=120)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            go = grpcclient.InferInput("GO", [1], "INT32")
            go.set_data_from_numpy(np.array([1], dtype=np.int32))
            order = client.infer("caller", [go], client_timeout=60).as_numpy("ORDER").tolist()
    finally:
        server.stop()
    assert order == [0, 2, 3, 4, 1], f"execution order by tag (0 holds; 1-3 default; 4 priority 1): {order}"


@pytest.mark.server
def test_the_built_backend_serves_without_workarounds_and_stops_cleanly(tiny_checkpoint, tmp_path):
    """No preloaded library, no iterator retirement; a stop after streaming is graceful (every model unloads after SIGINT, no escalation) and logs no crash."""
    built, why_not = load_built_backend()
    if built is None:
        pytest.skip(why_not)
    from conftest import TEST_LIMITS
    from server_fixture import start_server

    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, torch_threads={stage: 1 for stage in STAGES},
                          **TEST_LIMITS)
    handle = start_server(config, tmp_path, python_backend="built")
    try:
        env = handle.server.install.environment()
        assert bundled_backend.SWITCH not in env and "LD_PRELOAD" not in handle.server.install.stub_fixes
        stubs = handle.server.stub_pids()
        for pid in stubs.values():
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"{bundled_backend.SWITCH}=1".encode() not in environ
        with OmniStreamClient(handle.grpc_url) as client:
            result = client.stream("a clean stop", temperature=0.0, max_tokens=4, max_audio_frames=8)
        assert result.audio_seconds > 0
    finally:
        started = time.monotonic()
        handle.server.stop()
        stop_s = time.monotonic() - started
    log = handle.server.log_path.read_text(errors="replace")
    alarms = [line for line in log.splitlines() if any(alarm in line for alarm in SHUTDOWN_ALARMS)]
    assert not alarms, f"shutdown logged: {alarms[:5]}"
    # graceful: every model unloaded after SIGINT (a stop that needed SIGTERM/SIGKILL hung somewhere); how long
    # that takes depends on the machine's load, so it is printed, not bounded
    print(f"\nstop: {handle.server.stop_outcome} in {stop_s:.1f} s")
    assert handle.server.stop_outcome == "graceful", f"stop {handle.server.stop_outcome} after {stop_s:.1f} s"
    leftover = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub.*{handle.server.shm_prefix}"],
                              capture_output=True, text=True).stdout.split()
    assert not leftover, f"stub processes left: {leftover}"
