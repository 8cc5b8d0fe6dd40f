"""Helpers every model_repository/*/1/model.py uses to read its launch configuration."""

from __future__ import annotations

import atexit
import faulthandler
import json


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` block of the model's config.pbtxt as {key: string value}."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def replica_labels(args: dict) -> dict[str, str]:
    """Metric labels that tell this instance from its replicas (``serve --instances``): its instance name
    (talker_0_1) under ``model_instance`` when the model has several instances, else none. Without it the
    replicas would write one series, each overwriting the others' gauges. (Not ``instance``: Prometheus sets
    that label to the scraped target.)"""
    groups = json.loads(args["model_config"]).get("instance_group", [])
    instances = sum(int(group.get("count", 1)) * max(1, len(group.get("gpus", []))) for group in groups)
    return {"model_instance": args["model_instance_name"]} if instances > 1 else {}


def limit_torch_threads(threads: int) -> None:
    """Each stage is its own stub process: without a cap, every one of them spawns a thread per core."""
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set: only allowed once per process, before any parallel work
        pass


def report_native_crashes() -> None:
    """A stub that dies of a signal (a native crash) prints every thread's Python stack to the server's log
    first: Triton itself only notices later that the stub is gone, and says nothing about why. Not while the
    interpreter shuts down: the stubs of this Triton build crash in their final garbage collection after
    every model is unloaded, which is harmless and would fill the log with alarms at every shutdown."""
    faulthandler.enable(all_threads=True)
    atexit.register(faulthandler.disable)
