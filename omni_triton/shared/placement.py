"""Where each stage runs: which GPUs (``--stage-gpus``), how many instances per GPU (``--instances``), and how many
whole pipelines one server runs (``--pipelines``).

Rendered into each model's ``instance_group`` (Triton's own replica mechanism: one stub process per instance,
each told its GPU in ``model_instance_device_id``), and read by the memory plan, which sizes the KV caches per
GPU from what that GPU holds. ``count`` is per listed GPU, as in Triton's instance_group: ``--stage-gpus
talker=1:2 --instances talker=2`` runs four talker instances, two on each of GPUs 1 and 2.

Only the talker, code2wav and the orchestrator take more than one instance. The talker's and code2wav's requests
either belong to one sequence (the talker: Triton's sequence batcher sends every chunk of a correlation id, its
abort included, to the instance holding it) or stand alone (a code2wav chunk). The thinker takes aborts by request
id that Triton would route to any instance, not the one holding the request; it runs one instance (per pipeline).
Orchestrator instances (``--instances orchestrator=K``: K per pipeline, each its own process, so the orchestrator's
CPU work, one GIL a process, is spread over K cores) each take the requests Triton hands them and run them on their
pipeline; their cancels and drains meet in the server's ``CancelRegistry``.

Pipelines (``--pipelines N``): N copies of thinker, talker and code2wav, each copy its own Triton models
(``thinker_p0``, ``talker_p0``, ``code2wav_p0``, ``thinker_p1``, ...: ``pipeline_model``) on its own GPUs, and the
orchestrator's instances per pipeline (the one ``orchestrator`` model, an instance group per pipeline named
``orchestrator_p<k>`` on that pipeline's GPU: ``orchestrator_instance`` reads the pipeline and the instance's index
back from the instance's name). Each orchestrator instance sends its requests, and every call of theirs, to its own
pipeline's models by name, so a request's tensors stay on its pipeline's GPUs and its aborts reach the one thinker
that holds it; one orchestrator process per pipeline (or more) keeps the orchestrator's own CPU work from capping
the server. ``--stage-gpus`` and ``--instances`` describe pipeline 0; pipeline k runs the same layout shifted by k
GPU groups (a group: GPUs 0 to the highest pipeline 0 uses), so ``--pipelines 2`` puts pipeline 1 on GPU 1, and
``--pipelines 2 --stage-gpus thinker=0,talker=1,code2wav=1`` puts it on GPUs 2 and 3. One pipeline keeps the
stages' own names (``thinker``, ...) and, with one orchestrator instance, Triton's default instance group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

GPU_STAGES = ("thinker", "talker", "code2wav", "orchestrator")  # preprocess runs on the CPU
ENGINE_STAGES = ("thinker", "talker")
REPLICABLE_STAGES = ("talker", "code2wav", "orchestrator")
PIPELINE_STAGES = ("thinker", "talker", "code2wav")  # one model per pipeline; preprocess and orchestrator: one each
PER_PIPELINE_STAGES = (*PIPELINE_STAGES, "orchestrator")  # instances per pipeline (the orchestrator's in one model)
_PIPELINE_MODEL = re.compile(r"^(%s)_p(\d+)$" % "|".join(PIPELINE_STAGES))
_ORCHESTRATOR_INSTANCE = re.compile(r"^orchestrator_p(\d+)_(\d+)$")  # Triton names instances <group>_<index>
_DEFAULT_GROUP_INSTANCE = re.compile(r"^orchestrator_0_(\d+)$")  # one instance: Triton's default group


def pipeline_model(stage: str, pipeline: int, pipelines: int) -> str:
    """The Triton model of ``stage`` in ``pipeline`` (of ``pipelines``): ``thinker_p1``; with one pipeline the
    stage's own name."""
    return f"{stage}_p{pipeline}" if pipelines > 1 and stage in PIPELINE_STAGES else stage


def model_stage(model: str) -> tuple[str, int]:
    """(stage, pipeline) of a model that ``pipeline_model`` named (any other model: its own name, pipeline 0)."""
    match = _PIPELINE_MODEL.match(model)
    return (match.group(1), int(match.group(2))) if match else (model, 0)


def orchestrator_instance(instance_name: str, pipelines: int) -> tuple[int, int]:
    """(pipeline, index within it) of an orchestrator instance, from its Triton instance name: ``orchestrator_p1_0``
    is instance 0 of group ``orchestrator_p1`` (``Placement.instance_group``); with one pipeline and one instance,
    Triton's default group, ``orchestrator_0_0``."""
    match = _ORCHESTRATOR_INSTANCE.match(instance_name)
    if match is not None and int(match.group(1)) < pipelines:
        return int(match.group(1)), int(match.group(2))
    default = _DEFAULT_GROUP_INSTANCE.match(instance_name)
    if pipelines == 1 and default is not None:
        return 0, int(default.group(1))
    raise ValueError(f"orchestrator instance {instance_name!r} names none of {pipelines} pipelines "
                     "(expected orchestrator_p<k>_<index>)")


@dataclass(frozen=True)
class OrchestratorSlot:
    """Which of the server's orchestrator instances one is: ``index`` among its pipeline's ``per_pipeline``
    (``--instances orchestrator``: the pipeline's admission limits and capacity are split among them, and only
    index 0 reloads a stage that died), of ``total`` in the server (a drain waits for all of them)."""
    index: int = 0
    per_pipeline: int = 1
    total: int = 1


class PlacementError(ValueError):
    """A placement option that is malformed or impossible; the message names the option and the value."""


@dataclass(frozen=True)
class Placement:
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # stage -> GPU ids; absent: the default
    instances: Mapping[str, int] = field(default_factory=dict)         # stage -> instances per GPU; absent: 1
    pipelines: int = 1                                                 # whole pipelines, each on its GPU group

    def __post_init__(self):
        if self.pipelines < 1:
            raise PlacementError(f"--pipelines {self.pipelines}: expected a count >= 1")
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
                    f"--instances {stage}={count}: only {', '.join(REPLICABLE_STAGES)} take more than one "
                    f"instance ({stage} takes control requests by request id, which Triton routes to any instance; "
                    f"for more thinkers run whole pipelines: --pipelines N)")
        # the thinker: one instance per pipeline (control requests find it by id); the orchestrator's instances of
        # a pipeline share its GPU (each asks its pipeline's stage outputs to land there)
        for stage in ("thinker", "orchestrator"):
            if stage in self.gpus and len(self.gpus[stage]) > 1:
                raise PlacementError(f"--stage-gpus {stage}={_ids(self.gpus[stage])}: the {stage} runs on one GPU "
                                     "per pipeline")

    def gpus_of(self, stage: str, pipeline: int = 0) -> tuple[int, ...]:
        """The GPUs of ``stage`` in ``pipeline``: its own, else the orchestrator follows the thinker, and every stage
        defaults to GPU 0; pipeline k's shifted by k GPU groups."""
        if stage == "orchestrator" and stage not in self.gpus:
            return self.gpus_of("thinker", pipeline)
        ids = tuple(self.gpus[stage]) if stage in self.gpus else (0,)
        shift = pipeline * self.group_size if stage in PER_PIPELINE_STAGES else 0
        return tuple(gpu + shift for gpu in ids)

    @property
    def group_size(self) -> int:
        """GPUs per pipeline: 0 to the highest GPU pipeline 0 uses."""
        return 1 + max(gpu for stage in GPU_STAGES for gpu in (self.gpus[stage] if stage in self.gpus else (0,)))

    def pipeline_gpu(self, pipeline: int) -> int:
        """Where ``pipeline``'s orchestrator instance runs and asks its stage outputs to land: the thinker's GPU of
        that pipeline by default (a stage on another GPU of the group gets them device to device)."""
        return self.gpus_of("orchestrator", pipeline)[0]

    def models(self, pipeline: int) -> dict[str, str]:
        """stage -> the Triton model of it in ``pipeline`` (``pipeline_model``)."""
        return {stage: pipeline_model(stage, pipeline, self.pipelines) for stage in PIPELINE_STAGES}

    def count(self, stage: str) -> int:
        return self.instances.get(stage, 1)

    def pipelines_of(self, stage: str) -> range:
        """The pipelines that have a model of ``stage`` of their own (the orchestrator is one model for all)."""
        return range(self.pipelines) if stage in PIPELINE_STAGES else range(1)

    def instance_pipelines(self, stage: str) -> range:
        """The pipelines that have instances of ``stage`` of their own (the orchestrator too: one each)."""
        return range(self.pipelines) if stage in PER_PIPELINE_STAGES else range(1)

    def used_gpus(self) -> tuple[int, ...]:
        return tuple(sorted({gpu for stage in GPU_STAGES for pipeline in self.instance_pipelines(stage)
                             for gpu in self.gpus_of(stage, pipeline)}))

    def held(self, gpu: int) -> dict[str, int]:
        """stage -> instances of it on ``gpu``, over every pipeline (stages with none left out)."""
        held = {stage: self.count(stage) * sum(gpu in self.gpus_of(stage, pipeline)
                                               for pipeline in self.instance_pipelines(stage)) for stage in GPU_STAGES}
        return {stage: count for stage, count in held.items() if count}

    @property
    def orchestrator_instances(self) -> int:
        """The server's orchestrator processes: ``--instances orchestrator`` per pipeline."""
        return self.count("orchestrator") * self.pipelines

    def instance_group(self, stage: str, device: str, pipeline: int = 0) -> str:
        """The ``instance_group`` block of ``stage``'s config.pbtxt (in ``pipeline``) on ``device`` (cpu: the
        count only). With pipelines or several orchestrator instances, the orchestrator's has a group per pipeline,
        ``orchestrator_p<k>``, of its instances on that pipeline's GPU: Triton names them ``orchestrator_p<k>_<i>``
        on either device, which tells each its pipeline (``orchestrator_instance``; one group listing every GPU
        would name all its instances ``orchestrator_0_<i>``)."""
        if stage == "orchestrator" and self.orchestrator_instances > 1:
            kind = "KIND_CPU" if device == "cpu" else "KIND_GPU"
            groups = [f'{{ name: "orchestrator_p{pipeline}" count: {self.count(stage)} kind: {kind}'
                      + ("" if device == "cpu" else f" gpus: [ {self.pipeline_gpu(pipeline)} ]") + " }"
                      for pipeline in range(self.pipelines)]
            return f"instance_group [ {', '.join(groups)} ]"
        if device == "cpu":
            return f"instance_group [ {{ count: {self.count(stage)} kind: KIND_CPU }} ]"
        return (f"instance_group [ {{ count: {self.count(stage)} kind: KIND_GPU "
                f"gpus: [ {', '.join(map(str, self.gpus_of(stage, pipeline)))} ] }} ]")

    def describe(self, device: str = "cuda") -> str:
        """One line: ``thinker x1 on GPU 0, talker x2 on GPU 1, ...`` (on the CPU: the counts); with pipelines,
        ``2 pipelines: thinker x1 on GPU 0 | 1, ...``."""
        def where(stage: str) -> str:
            if device != "cuda":
                return ""
            return " on GPU " + " | ".join(_ids(self.gpus_of(stage, pipeline))
                                           for pipeline in self.instance_pipelines(stage))

        stages = ", ".join(f"{stage} x{self.count(stage)}{where(stage)}" for stage in GPU_STAGES)
        return stages if self.pipelines == 1 else f"{self.pipelines} pipelines: {stages}"

    def as_options(self) -> list[str]:
        """The ``serve`` options that give this placement (empty for the default)."""
        options = []
        if self.gpus:
            options += ["--stage-gpus", ",".join(f"{s}={_ids(g)}" for s, g in self.gpus.items())]
        if self.instances:
            options += ["--instances", ",".join(f"{s}={n}" for s, n in self.instances.items())]
        if self.pipelines > 1:
            options += ["--pipelines", str(self.pipelines)]
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
