"""omni_triton/bench/wait_for_load.py: a profile's window waits until the server holds the level's streams; read
from a real HTTP endpoint serving Prometheus text (the server's metrics format)."""

from __future__ import annotations

import http.server
import threading

import pytest

from omni_triton.bench import wait_for_load

METRICS = """# HELP omni_active_requests Requests the stage currently holds
# TYPE omni_active_requests gauge
omni_active_requests{{stage="orchestrator",model_instance="orchestrator_p0_0"}} {a}
omni_active_requests{{stage="orchestrator",model_instance="orchestrator_p0_1"}} {b}
omni_active_requests{{stage="talker"}} 50
"""


@pytest.fixture
def metrics_server():
    held = {"a": 0, "b": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.format(**held).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)
            held["a"] += 1  # the load ramps: one more request each scrape

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", held
    server.shutdown()


def test_it_counts_the_orchestrator_instances_only():
    gauges = {"omni_active_requests{model_instance=orchestrator_p0_0,stage=orchestrator}": 3.0,
              "omni_active_requests{model_instance=orchestrator_p0_1,stage=orchestrator}": 4.0,
              "omni_active_requests{stage=talker}": 9.0, "omni_kv_blocks_used{stage=orchestrator}": 5.0}
    assert wait_for_load.orchestrator_streams(gauges) == 7.0


def test_it_waits_for_the_load_then_returns(metrics_server):
    url, held = metrics_server
    held["b"] = 2
    assert wait_for_load.main([url, "5", "30"]) == 0
    assert held["a"] + held["b"] >= 5 + 1  # it scraped until 3 + 2 were held (then one more was counted)


def test_it_gives_up_at_its_timeout(metrics_server):
    url, _ = metrics_server
    assert wait_for_load.main([url, "1000", "0.5"]) == 1
    assert wait_for_load.main(["http://127.0.0.1:9/metrics", "1", "0.3"]) == 1  # no server there: looked again
    assert wait_for_load.main([url]) == 2
