"""Where each stage runs: which GPUs (``--stage-gpus``) and how many instances per GPU (``--instances``).

Rendered into each model's ``instance_group`` (Triton's own replica mechanism: one stub process per instance,
each told its GPU in ``model_instance_device_id``), and read by the memory plan, which sizes the KV caches per
GPU from what that GPU holds. ``count`` is per listed GPU, as in Triton's instance_group: ``--stage-gpus
talker=1:2 --instances talker=2`` runs four talker instances, two on each of GPUs 1 and 2.

Only the talker and code2wav take more than one instance. Their requests either belong to one sequence (the
talker: Triton's sequence batcher sends every chunk of a correlation id, its abort included, to the instance
holding it) or stand alone (a code2wav chunk). The thinker and the orchestrator take control requests by
request id (an abort, a client's cancel) that Triton would route to any instance, not the one holding the
request; they run one instance each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

GPU_STAGES = ("thinker", "talker", "code2wav", "orchestrator")  # preprocess runs on the CPU
ENGINE_STAGES = ("thinker", "talker")
REPLICABLE_STAGES = ("talker", "code2wav")


class PlacementError(ValueError):
    """A placement option that is malformed or impossible; the message names the option and the value."""


@dataclass(frozen=True)
class Placement:
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # stage -> GPU ids; absent: the default
    instances: Mapping[str, int] = field(default_factory=dict)         # stage -> instances per GPU; absent: 1

    def __post_init__(self):
        for option, mapping in (("--stage-gpus", self.gpus), ("--instances", self.instances)):
            unknown = sorted(set(mapping) - set(GPU_STAGES))
            if unknown:
                raise PlacementError(f"{option}: unknown stage {unknown[0]!r} (stages: {', '.join(GPU_STAGES)})")
        for stage, ids in self.gpus.items():
            if not ids or any(gpu < 0 for gpu in ids) or len(set(ids)) != len(ids):
                raise PlacementError(f"--stage-gpus {stage}={_ids(ids)}: expected distinct GPU ids >= 0")
        for stage, count in self.instances.items():
            if count < 1:
                raise PlacementError(f"--instances {stage}={count}: expected a count >= 1")
            if count > 1 and stage not in REPLICABLE_STAGES:
                raise PlacementError(
                    f"--instances {stage}={count}: only {' and '.join(REPLICABLE_STAGES)} take more than one "
                    f"instance ({stage} takes control requests by request id, which Triton routes to any instance)")
        thinker_gpus = self.gpus_of("thinker")
        if "thinker" in self.gpus and len(thinker_gpus) > 1:
            raise PlacementError(f"--stage-gpus thinker={_ids(thinker_gpus)}: the thinker runs one instance, on "
                                 "one GPU")

    def gpus_of(self, stage: str) -> tuple[int, ...]:
        """The GPUs of ``stage``: its own, else the orchestrator follows the thinker, and every stage defaults
        to GPU 0."""
        if stage in self.gpus:
            return tuple(self.gpus[stage])
        if stage == "orchestrator":
            return self.gpus_of("thinker")
        return (0,)

    def count(self, stage: str) -> int:
        return self.instances.get(stage, 1)

    def used_gpus(self) -> tuple[int, ...]:
        return tuple(sorted({gpu for stage in GPU_STAGES for gpu in self.gpus_of(stage)}))

    def held(self, gpu: int) -> dict[str, int]:
        """stage -> instances of it on ``gpu`` (stages with none left out)."""
        return {stage: self.count(stage) for stage in GPU_STAGES if gpu in self.gpus_of(stage)}

    def instance_group(self, stage: str, device: str) -> str:
        """The ``instance_group`` block of ``stage``'s config.pbtxt on ``device`` (cpu: the count only)."""
        if device == "cpu":
            return f"instance_group [ {{ count: {self.count(stage)} kind: KIND_CPU }} ]"
        return (f"instance_group [ {{ count: {self.count(stage)} kind: KIND_GPU "
                f"gpus: [ {', '.join(map(str, self.gpus_of(stage)))} ] }} ]")

    def describe(self, device: str = "cuda") -> str:
        """One line: ``thinker x1 on GPU 0, talker x2 on GPU 1, ...`` (on the CPU: the counts)."""
        return ", ".join(f"{stage} x{self.count(stage)}" + (f" on GPU {_ids(self.gpus_of(stage))}" if device == "cuda"
                                                            else "") for stage in GPU_STAGES)

    def as_options(self) -> list[str]:
        """The ``serve`` options that give this placement (empty for the default)."""
        options = []
        if self.gpus:
            options += ["--stage-gpus", ",".join(f"{s}={_ids(g)}" for s, g in self.gpus.items())]
        if self.instances:
            options += ["--instances", ",".join(f"{s}={n}" for s, n in self.instances.items())]
        return options


def _ids(ids: tuple[int, ...]) -> str:
    return ":".join(map(str, ids))


def parse_stage_gpus(text: str) -> dict[str, tuple[int, ...]]:
    """``thinker=0,talker=1,code2wav=1`` (several GPUs: ``talker=1:2``) -> {stage: GPU ids}."""
    return {stage: tuple(_int("--stage-gpus", stage, part) for part in value.split(":"))
            for stage, value in _pairs("--stage-gpus", text, "thinker=0,talker=1,code2wav=1:2").items()}


def parse_instances(text: str) -> dict[str, int]:
    """``talker=2,code2wav=2`` -> {stage: instances per GPU}."""
    return {stage: _int("--instances", stage, value)
            for stage, value in _pairs("--instances", text, "talker=2,code2wav=2").items()}


def _pairs(option: str, text: str, example: str) -> dict[str, str]:
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, equals, value = item.partition("=")
        if not equals or not stage or not value:
            raise PlacementError(f"{option} {text}: expected STAGE=VALUE pairs, e.g. {example}; got {item!r}")
        if stage in pairs:
            raise PlacementError(f"{option} {text}: stage {stage!r} given twice")
        pairs[stage] = value
    return pairs


def _int(option: str, stage: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise PlacementError(f"{option} {stage}={value}: {value!r} is not a number") from None
