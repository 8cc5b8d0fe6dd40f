"""bench.server_cpu's reading of /proc: which processes are the server's and what each is called (the per-level
numbers themselves are checked against a real server in tests/test_bench_cli.py)."""

from __future__ import annotations

from omni_triton.bench.server_cpu import ServerCpu, ms_per_request, process_name, serves_port

STUB = "/opt/backends/python/triton_python_backend_stub"


def test_a_stub_is_named_by_its_instance_and_the_server_by_its_binary():
    argv = [STUB, "/run/repository/talker/1/model.py", "omni_28001_x", "1048576", "1048576", "5701",
            "/opt/backends/python", "336", "talker_0_1", "DEFAULT"]
    assert process_name(argv) == "talker_0_1"
    assert process_name(["/opt/tritonserver/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    assert process_name(["/usr/bin/python3", "-m", "pytest"]) is None
    assert process_name([]) is None


def test_the_server_is_told_apart_by_its_grpc_port():
    assert serves_port(["tritonserver", "--grpc-port=28001"], 28001)
    assert not serves_port(["tritonserver", "--grpc-port=28001"], 8001)
    assert serves_port(["tritonserver", "--model-repository=/r"], 8001)  # Triton's default port
    assert not serves_port(["tritonserver", "--model-repository=/r"], 28001)


def test_no_reading_for_a_remote_server_or_a_port_nothing_serves():
    with ServerCpu("10.0.0.5:8001") as remote:
        pass
    assert remote.percent is None and remote.seconds is None
    with ServerCpu("127.0.0.1:1") as nothing:  # no tritonserver serves port 1 here
        pass
    assert nothing.percent is None


def test_cpu_per_request_is_each_process_s_cpu_over_the_completed_requests():
    assert ms_per_request({"orchestrator_0_0": 1.5, "tritonserver": 0.25}, 10) == {"orchestrator_0_0": 150.0,
                                                                                  "tritonserver": 25.0}
    assert ms_per_request({"orchestrator_0_0": 1.5}, 0) is None  # nothing completed: no per-request cost
    assert ms_per_request(None, 4) is None  # no reading (a remote server)
