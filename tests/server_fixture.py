"""A real tritonserver for integration tests: tiny checkpoint, rendered repository, free ports, always stopped."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omni_triton.launch.repository import TEMPLATE_DIR, available_models, render_repository
from omni_triton.shared.settings import STAGES, LaunchConfig
from omni_triton.launch.tritonserver import (ServerOptions, TritonServer, find_tritonserver, free_port,
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

    def stop_after_tests(self) -> None:
        """A fixture's server once its tests are done: killed at once (its stubs with it, its shared memory
        removed). Nothing after reads what a graceful stop would still write, and the graceful stop, some 2 s a
        server, is tested on its own (tests/test_python_backend.py, tests/test_server_restart.py)."""
        self.server.stop(graceful=False)


def stage_args(config_text: str, model: str) -> dict[str, str]:
    """What tritonserver hands a stage's ``initialize`` for a rendered config.pbtxt: ``model_config`` as JSON,
    parsed from the text format as the server does, so that a test reads the settings back with the stub's own
    code (``omni_triton.stages.model_args``)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_text, model_config_pb2.ModelConfig())
    return {"model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
            "model_name": model, "model_instance_name": f"{model}_0_0", "model_instance_device_id": "0"}


def rendered_settings(out: Path, model: str) -> LaunchConfig:
    """The launch settings the stage ``model`` of the rendered repository ``out`` reads back."""
    from omni_triton.stages.model_args import launch_settings

    return launch_settings(stage_args((out / model / "config.pbtxt").read_text(), model))


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
    [handle] = start_servers([(config, run_dir)], models, ready_timeout_s, python_backend)
    return handle


def start_servers(runs: list[tuple[LaunchConfig, Path]], models: list[str] | None = None,
                  ready_timeout_s: float = 180.0, python_backend: str | None = None) -> list[ServerHandle]:
    """A server per (config, run dir), all started before any is waited for: their loads overlap (one server's
    load leaves a core idle at times)."""
    models = servable_models() if models is None else models
    servers = []
    try:
        for config, run_dir in runs:
            repository = render_repository(config, run_dir / "repository", models)
            options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
            servers.append(TritonServer(repository, find_tritonserver(python_backend=python_backend), options,
                                        log_path=run_dir / "tritonserver.log").start())
        # every rendered model (--pipelines: thinker_p0, ...)
        ready = [server.wait_ready(timeout_s=ready_timeout_s) for server in servers]
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return [ServerHandle(server, config, models, ready_s) for server, (config, _), ready_s in zip(servers, runs, ready)]


@contextmanager
def serving(checkpoint_dir: Path, run_dir: Path, **launch) -> Iterator[ServerHandle]:
    """A server on ``checkpoint_dir`` with one torch thread per stage and ``launch`` settings, stopped on exit
    (for a module's own server fixture)."""
    config = LaunchConfig(checkpoint_dir=checkpoint_dir, torch_threads={stage: 1 for stage in STAGES}, **launch)
    handle = start_server(config, run_dir)
    try:
        yield handle
    finally:
        handle.stop_after_tests()
