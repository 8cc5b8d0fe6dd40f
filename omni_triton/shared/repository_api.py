"""Reload one model of a running tritonserver through its HTTP repository API (explicit model control).

Used on both sides of the process boundary: the orchestrator's stage supervisor reloads a stage whose stub died,
the launcher (``TritonServer.supervise``) the orchestrator itself. Triton's core reloads a loaded model only when
its files or its config changed; after a stub died neither did, so a plain load is a no-op ("successfully loaded"
in 0 s, the model still answering "Stub process is not healthy"). The load therefore passes the model's own config
back as an override with one parameter that names this restart, which makes it a new config and the load a real
one. Triton reloads the models that depend on it (the ``omni`` ensemble on the orchestrator) in the same call.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import NamedTuple

RESTART_PARAMETER = "omni_triton_restart"


class ReloadError(ValueError):
    """The server refused or failed the load; the message is Triton's reason."""


def _served_config(http_url: str, model: str) -> dict:
    """The config ``model`` is served with now."""
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/config", timeout=30) as response:
        return json.loads(response.read())


def restart_mark(http_url: str, model: str) -> str | None:
    """The restart the config ``model`` is served with names (None: never reloaded, or the server did not answer):
    it changes once a reload's model serves."""
    try:
        config = _served_config(http_url, model)
    except (OSError, ValueError):
        return None
    return config.get("parameters", {}).get(RESTART_PARAMETER, {}).get("string_value")


class ReloadSteps(NamedTuple):
    """How long each step of ``reload_model`` took (seconds): reading the served config, then the load request
    (Triton's answer comes once the model and its dependents are loaded)."""
    config_s: float
    load_s: float


def reload_model(http_url: str, model: str, restart: str, timeout_s: float = 600.0) -> ReloadSteps:
    """Load ``model`` again with a fresh stub (``restart`` names this restart; a new value per restart). Returns
    once Triton says it is loaded (its dependents too); raises ReloadError with Triton's reason, OSError when the
    server cannot be reached."""
    start = time.monotonic()
    try:
        config = _served_config(http_url, model)
        config.setdefault("parameters", {})[RESTART_PARAMETER] = {"string_value": restart}
        body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
        request = urllib.request.Request(f"{http_url}/v2/repository/models/{model}/load", data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
        sent = time.monotonic()
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as error:  # Triton's reason, e.g. not in explicit model-control mode
        raise ReloadError(json.loads(error.read() or b"{}").get("error", str(error))) from None
    return ReloadSteps(sent - start, time.monotonic() - sent)
