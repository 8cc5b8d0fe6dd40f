"""``TritonServer.wait_ready``: ready means the health endpoints say so AND the metrics port answers (Triton starts
its metrics service ~40 ms after HTTP reports ready; a client reading the metrics at "ready" was refused in CI).
Stand-in endpoints (stdlib HTTP servers) and a stand-in process; the real server is started by every server test."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from omni_triton.launch.tritonserver import ServerOptions, TritonInstall, TritonServer, TritonServerError, free_port


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):  # quiet
        pass


def _serve(port: int) -> http.server.HTTPServer:
    server = http.server.HTTPServer(("127.0.0.1", port), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_wait_ready_waits_for_the_metrics_port(tmp_path):
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    install = TritonInstall(binary=tmp_path / "tritonserver", backend_dir=tmp_path, lib_dirs=(), origin="explicit")
    server = TritonServer(tmp_path, install, options)
    server.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live "server"
    endpoints = [_serve(options.http_port)]
    try:
        with pytest.raises(TritonServerError, match="not ready"):  # health says ready, metrics refused
            server.wait_ready(models=[], timeout_s=0.5)
        endpoints.append(_serve(options.metrics_port))
        assert server.wait_ready(models=[], timeout_s=5) < 5
    finally:
        for endpoint in endpoints:
            endpoint.shutdown()
        server.process.kill()
        server.process.wait()
