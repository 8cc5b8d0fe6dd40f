"""A real tritonserver for integration tests: tiny checkpoint, rendered repository, free ports, always stopped."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omni_triton.server.repository import STAGES, TEMPLATE_DIR, LaunchConfig, available_models, render_repository
from omni_triton.server.tritonserver import (ServerOptions, TritonServer, find_tritonserver, free_port,
                                             process_tree_rss_bytes)


@dataclass
class ServerHandle:
    server: TritonServer
    config: LaunchConfig
    models: list[str]
    ready_s: float

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config.checkpoint_dir)

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    def grpc_client(self):
        return self.server.grpc_client()

    def rss_bytes(self) -> int:
        return process_tree_rss_bytes(self.server.process.pid)


def rendered_parameters(config_text: str) -> dict[str, str]:
    """A rendered config.pbtxt's string parameters, as the stage reads them."""
    return dict(re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', config_text))


def servable_models(template_dir: Path = TEMPLATE_DIR) -> list[str]:
    """Every model template, less an ensemble whose step models are not written yet."""
    models = available_models(template_dir)
    servable = []
    for model in models:
        text = (template_dir / model / "config.pbtxt").read_text()
        steps = set(re.findall(r'model_name:\s*"([^"]+)"', text)) if 'platform: "ensemble"' in text else set()
        if steps <= set(models):
            servable.append(model)
    return servable


def start_server(config: LaunchConfig, run_dir: Path, models: list[str] | None = None,
                 ready_timeout_s: float = 180.0, python_backend: str | None = None) -> ServerHandle:
    """``python_backend``: auto (None: the built one when present), built or bundled."""
    models = servable_models() if models is None else models
    repository = render_repository(config, run_dir / "repository", models)
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(repository, find_tritonserver(python_backend=python_backend), options,
                          log_path=run_dir / "tritonserver.log")
    server.start()
    try:
        ready_s = server.wait_ready(models, timeout_s=ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return ServerHandle(server, config, models, ready_s)


@contextmanager
def serving(checkpoint_dir: Path, run_dir: Path, **launch) -> Iterator[ServerHandle]:
    """A server on ``checkpoint_dir`` with one torch thread per stage and ``launch`` settings, stopped on exit
    (for a module's own server fixture)."""
    config = LaunchConfig(checkpoint_dir=checkpoint_dir, torch_threads={stage: 1 for stage in STAGES}, **launch)
    handle = start_server(config, run_dir)
    try:
        yield handle
    finally:
        handle.server.stop()
