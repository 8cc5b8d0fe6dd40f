"""Stage placement and replicas (`serve --stage-gpus / --instances`): option parsing and its errors, the
instance_group each model's config.pbtxt gets, and the KV plan per GPU on fake free-memory numbers. No server
here (tests/test_server_replicas.py serves two talker and two code2wav instances)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from omni_triton import cli
from omni_triton.launch import serve
from omni_triton.launch.options import LaunchOptionError, placement
from omni_triton.launch.memory_plan import GIB, MIN_KV_TOKENS, DoesNotFit, Footprint, plan, plan_placement
from omni_triton.shared.placement import (OrchestratorSlot, Placement, PlacementError, parse_instances,
                                         parse_stage_gpus)
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from server_fixture import rendered_settings

H200 = (int(139.3 * GIB), "H200, 140 GiB")  # what torch reports free on an idle one
SPLIT = Placement(gpus={"thinker": (0,), "talker": (1,), "code2wav": (1,)})


@pytest.fixture(scope="module")
def full_footprint():
    from omni_triton.models.config import FULL_SIZE_CONFIG, resolve_config_dir

    return Footprint.from_checkpoint(resolve_config_dir(FULL_SIZE_CONFIG), torch.bfloat16)


def _instance_group(repository, model: str) -> str:
    return re.search(r"^instance_group \[.*\]$", (repository / model / "config.pbtxt").read_text(), re.M).group(0)


def test_stage_gpus_and_instances_render_into_each_instance_group(tiny_checkpoint, tmp_path):
    placed = Placement(gpus={"thinker": (0,), "talker": (1, 2), "code2wav": (1,)},
                       instances={"talker": 2, "code2wav": 3})
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", placement=placed),
                            tmp_path / "gpu")
    assert _instance_group(out, "thinker") == "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
    assert _instance_group(out, "talker") == "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1, 2 ] } ]"
    assert _instance_group(out, "code2wav") == "instance_group [ { count: 3 kind: KIND_GPU gpus: [ 1 ] } ]"
    # the orchestrator follows the thinker, and is told how many instances of each stage to watch
    assert _instance_group(out, "orchestrator") == "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
    assert rendered_settings(out, "orchestrator").placement == placed
    assert _instance_group(out, "preprocess") == "instance_group [ { count: 1 kind: KIND_CPU } ]"
    # the default on a GPU: every stage on GPU 0 only (Triton's own default would put one on every GPU)
    default = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda"), tmp_path / "default")
    for model in ("thinker", "talker", "code2wav", "orchestrator"):
        assert _instance_group(default, model) == "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
    cpu = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, placement=Placement(
        instances={"talker": 2, "code2wav": 2})), tmp_path / "cpu")
    assert _instance_group(cpu, "talker") == "instance_group [ { count: 2 kind: KIND_CPU } ]"
    assert _instance_group(cpu, "thinker") == "instance_group [ { count: 1 kind: KIND_CPU } ]"


def test_option_values_parse_and_round_trip():
    assert parse_stage_gpus("thinker=0,talker=1:2, code2wav=1") == {"thinker": (0,), "talker": (1, 2),
                                                                     "code2wav": (1,)}
    assert parse_instances("talker=2,code2wav=2") == {"talker": 2, "code2wav": 2}
    placed = Placement(gpus=parse_stage_gpus("thinker=0,talker=1:2"), instances=parse_instances("talker=2"))
    assert placed.as_options() == ["--stage-gpus", "thinker=0,talker=1:2", "--instances", "talker=2"]
    assert placed.used_gpus() == (0, 1, 2) and placed.held(1) == {"talker": 2}
    assert placed.held(0) == {"thinker": 1, "code2wav": 1, "orchestrator": 1}


@pytest.mark.parametrize("parse, text, message", [
    (parse_stage_gpus, "thinker:0", r"--stage-gpus thinker:0: expected STAGE=VALUE pairs.*got 'thinker:0'"),
    (parse_stage_gpus, "talker=one", r"--stage-gpus talker=one: 'one' is not a number"),
    (parse_stage_gpus, "talker=1,talker=2", r"--stage-gpus talker=1,talker=2: stage 'talker' given twice"),
    (parse_instances, "code2wav=x", r"--instances code2wav=x: 'x' is not a number"),
])
def test_malformed_values_are_refused_naming_option_and_value(parse, text, message):
    with pytest.raises(PlacementError, match=message):
        parse(text)


@pytest.mark.parametrize("gpus, instances, message", [
    ({"vocoder": (0,)}, {}, r"--stage-gpus: unknown stage 'vocoder' \(stages: thinker, talker, code2wav, "),
    ({}, {"preprocess": 2}, r"--instances: unknown stage 'preprocess'"),
    ({"talker": (1, 1)}, {}, r"--stage-gpus talker=1:1: expected distinct GPU ids >= 0"),
    ({"talker": (-1,)}, {}, r"--stage-gpus talker=-1: expected distinct GPU ids >= 0"),
    ({}, {"talker": 0}, r"--instances talker=0: expected a count >= 1"),
    ({}, {"thinker": 2}, r"--instances thinker=2: only talker, code2wav, orchestrator take more than one instance"),
    ({"thinker": (0, 1)}, {}, r"--stage-gpus thinker=0:1: the thinker runs on one GPU per pipeline"),
    ({"orchestrator": (0, 1)}, {}, r"--stage-gpus orchestrator=0:1: the orchestrator runs on one GPU per pipeline"),
])
def test_impossible_placements_are_refused_naming_option_and_value(gpus, instances, message):
    with pytest.raises(PlacementError, match=message):
        Placement(gpus=gpus, instances=instances)


@pytest.mark.parametrize("argv, message", [
    (["--stage-gpus", "talker=1"], "--stage-gpus places stages on GPUs: it needs --device cuda"),
    (["--device", "cuda", "--instances", "thinker=2"], "--instances thinker=2: only talker, code2wav, orchestrator"),
])
def test_serve_refuses_placements_by_option(argv, message):
    args = cli.build_parser().parse_args(["serve", *argv])
    with pytest.raises(LaunchOptionError, match=re.escape(message)):
        placement(args)


def test_serve_reports_a_malformed_value_through_argparse(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--instances", "talker=two"])
    assert "argument --instances: --instances talker=two: 'two' is not a number" in capsys.readouterr().err


def test_one_gpu_plan_equals_the_default_placement(full_footprint):
    alone = plan(full_footprint, H200[0], code2wav_frames=97, device_name=H200[1])
    placed = plan_placement(full_footprint, {0: H200}, Placement(), code2wav_frames=97)
    assert (alone.thinker_tokens, alone.talker_tokens) == (placed.thinker_tokens, placed.talker_tokens)
    held = placed.gpus[0]
    assert held.held == {"thinker": 1, "talker": 1, "code2wav": 1, "orchestrator": 1}
    assert held.weight_bytes == full_footprint.weight_bytes


def test_replicas_on_one_gpu_share_its_kv_memory(full_footprint):
    one = plan_placement(full_footprint, {0: H200}, Placement(), code2wav_frames=97)
    two = plan_placement(full_footprint, {0: H200}, Placement(instances={"talker": 2, "code2wav": 2}),
                         code2wav_frames=97)
    gpu = two.gpus[0]
    # a second talker and code2wav: their weights, processes, engine step and activations come off the KV
    extra = (full_footprint.talker_bytes + full_footprint.code2wav_bytes + one.gpus[0].code2wav_activation_bytes)
    assert gpu.weight_bytes == one.gpus[0].weight_bytes + full_footprint.talker_bytes + full_footprint.code2wav_bytes
    assert gpu.kv_bytes < one.gpus[0].kv_bytes - extra
    # what is left splits as before (the thinker's share to the thinker), the two talkers halve the talkers' share
    shrink = gpu.kv_bytes / one.gpus[0].kv_bytes
    assert two.thinker_tokens == pytest.approx(one.thinker_tokens * shrink, rel=0.01)
    assert two.talker_tokens == pytest.approx(one.talker_tokens * shrink / 2, rel=0.01)
    used = (gpu.weight_bytes + gpu.reserved_bytes + two.thinker_kv_bytes + 2 * two.talker_kv_bytes)
    assert used <= 0.95 * H200[0]


def test_split_placement_plans_each_gpu_from_what_it_holds(full_footprint):
    split = plan_placement(full_footprint, {0: H200, 1: H200}, SPLIT, max_inflight=64, code2wav_frames=97)
    thinker_gpu, talker_gpu = split.gpus
    assert thinker_gpu.held == {"thinker": 1, "orchestrator": 1}
    assert talker_gpu.held == {"talker": 1, "code2wav": 1}
    assert thinker_gpu.weight_bytes == full_footprint.thinker_bytes
    assert talker_gpu.talker_tokens is not None and thinker_gpu.talker_tokens is None
    one = plan_placement(full_footprint, {0: H200}, Placement(), max_inflight=64, code2wav_frames=97)
    # the thinker gets the whole of GPU 0's KV memory, not 70% of what one GPU left
    assert split.thinker_tokens > 1.5 * one.thinker_tokens
    assert split.talker_tokens == min(64 * full_footprint.talker_context, talker_gpu.talker_tokens)
    assert "GPU 1 (H200, 140 GiB)" in split.describe() and "talker x1 + code2wav x1" in split.describe()


def test_a_placement_that_does_not_fit_names_the_gpu_and_what_would_fit(full_footprint):
    h100 = (int(78.6 * GIB), "H100, 80 GiB")
    crowded = Placement(gpus={"thinker": (0,), "talker": (1,), "code2wav": (1,)},
                        instances={"talker": 8, "code2wav": 2})
    small = {0: H200, 1: (int(20 * GIB), "L4, 24 GiB")}
    with pytest.raises(DoesNotFit) as refused:
        plan_placement(full_footprint, small, crowded, code2wav_frames=97)
    message = str(refused.value)
    assert "does not fit GPU 1 (L4, 24 GiB)" in message and "it holds talker x8 + code2wav x2" in message
    fits = re.search(r"on GPU 1 fits: talker x(\d+) \+ code2wav x(\d+) \(--instances talker=\1,code2wav=\2\)",
                     message)
    assert fits, message
    talkers, vocoders = int(fits.group(1)), int(fits.group(2))
    assert 1 <= talkers < 8 and 1 <= vocoders <= 2
    fitted = plan_placement(full_footprint, small, Placement(gpus=crowded.gpus,
                            instances={"talker": talkers, "code2wav": vocoders}), code2wav_frames=97)
    assert fitted.talker_tokens >= MIN_KV_TOKENS
    # the whole pipeline on one H100 still names the layers that fit
    with pytest.raises(DoesNotFit, match=r"does not fit GPU 0 \(H100.*--dummy-layers \d+"):
        plan_placement(full_footprint, {0: h100}, Placement(), code2wav_frames=97)


def test_a_gpu_that_is_not_visible_is_refused(full_footprint):
    with pytest.raises(DoesNotFit, match=r"--stage-gpus: GPU 1 is not visible here \(1 GPU\(s\): ids 0\)"):
        plan_placement(full_footprint, {0: H200}, SPLIT)


def test_serve_gives_tritonserver_a_cuda_pool_on_every_gpu_it_uses(tiny_checkpoint):
    from omni_triton.launch.tritonserver import TritonInstall, TritonServer

    args = cli.build_parser().parse_args(["serve", "--device", "cuda", "--stage-gpus", "thinker=0,talker=2"])
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", placement=placement(args))
    options = serve.server_options(args, config)
    install = TritonInstall(binary=tiny_checkpoint / "tritonserver", backend_dir=tiny_checkpoint, lib_dirs=(),
                            origin="explicit")
    install.__dict__["help_text"] = ""  # no binary to ask: a build without --allow-client-shm
    command = TritonServer(tiny_checkpoint, install, options).command()
    pools = [arg for arg in command if arg.startswith("--cuda-memory-pool-byte-size=")]
    assert [pool.split("=")[1].split(":")[0] for pool in pools] == ["0", "2"]
    assert {pool.split(":")[1] for pool in pools} == {str(256 << 20)}  # the default
    larger = cli.build_parser().parse_args(["serve", "--device", "cuda", "--cuda-memory-pool-mb", "2048"])
    command = TritonServer(tiny_checkpoint, install, serve.server_options(larger, config)).command()
    assert {arg.split(":")[1] for arg in command if arg.startswith("--cuda-memory-pool")} == {str(2048 << 20)}


@pytest.mark.parametrize("value", ["0", "1.5", "lots"])
def test_a_pool_size_that_is_not_whole_mib_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--cuda-memory-pool-mb", value])
    assert "--cuda-memory-pool-mb" in capsys.readouterr().err


def test_pipelines_render_each_stage_once_per_pipeline_on_its_gpu_group(tiny_checkpoint, tmp_path):
    """--pipelines 2: thinker_p0 on GPU 0 and thinker_p1 on GPU 1, ...; with the split as pipeline 0's layout,
    pipeline 1 takes GPUs 2 and 3. The orchestrator runs an instance per pipeline, on that pipeline's first GPU, in
    an instance group named after the pipeline."""
    args = cli.build_parser().parse_args(["serve", "--device", "cuda", "--pipelines", "2",
                                          "--instances", "orchestrator=1"])
    two = placement(args)
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", placement=two), tmp_path / "a")
    assert sorted(p.name for p in out.iterdir()) == ["code2wav_p0", "code2wav_p1", "omni", "orchestrator",
                                                     "preprocess", "talker_p0", "talker_p1", "thinker_p0", "thinker_p1"]
    for stage in ("thinker", "talker", "code2wav"):
        for pipeline in (0, 1):
            text = (out / f"{stage}_p{pipeline}" / "config.pbtxt").read_text()
            assert f'name: "{stage}_p{pipeline}"' in text
            assert _instance_group(out, f"{stage}_p{pipeline}") == (
                f"instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ {pipeline} ] }} ]")
    assert _instance_group(out, "orchestrator") == (
        'instance_group [ { name: "orchestrator_p0" count: 1 kind: KIND_GPU gpus: [ 0 ] }, '
        '{ name: "orchestrator_p1" count: 1 kind: KIND_GPU gpus: [ 1 ] } ]')
    assert rendered_settings(out, "thinker_p1").placement == two
    assert two.used_gpus() == (0, 1)
    assert two.held(1) == {"thinker": 1, "talker": 1, "code2wav": 1, "orchestrator": 1}
    assert [two.pipeline_gpu(p) for p in (0, 1)] == [0, 1]
    assert two.as_options() == ["--instances", "orchestrator=1", "--pipelines", "2"]
    assert two.describe() == ("2 pipelines: thinker x1 on GPU 0 | 1, talker x1 on GPU 0 | 1, code2wav x1 on GPU "
                              "0 | 1, orchestrator x1 on GPU 0 | 1")
    split = Placement(gpus=SPLIT.gpus, instances={"talker": 2}, pipelines=2)
    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", placement=split),
                            tmp_path / "split")
    assert _instance_group(out, "thinker_p1") == "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 2 ] } ]"
    assert _instance_group(out, "talker_p1") == "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 3 ] } ]"
    assert split.used_gpus() == (0, 1, 2, 3) and [split.pipeline_gpu(p) for p in (0, 1)] == [0, 2]
    assert _instance_group(out, "orchestrator") == (
        'instance_group [ { name: "orchestrator_p0" count: 1 kind: KIND_GPU gpus: [ 0 ] }, '
        '{ name: "orchestrator_p1" count: 1 kind: KIND_GPU gpus: [ 2 ] } ]')
    cpu = Placement(pipelines=3).instance_group("orchestrator", "cpu")
    assert cpu == ('instance_group [ { name: "orchestrator_p0" count: 1 kind: KIND_CPU }, '
                   '{ name: "orchestrator_p1" count: 1 kind: KIND_CPU }, '
                   '{ name: "orchestrator_p2" count: 1 kind: KIND_CPU } ]')
    # one pipeline keeps the stages' own names
    one = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint), tmp_path / "one")
    assert 'name: "thinker"' in (one / "thinker" / "config.pbtxt").read_text()


@pytest.mark.parametrize("argv, orchestrators", [
    (["--device", "cuda"], 2),                                   # the GPU's default: two processes per pipeline
    (["--device", "cuda", "--pipelines", "2"], 2),               # ... per pipeline
    (["--device", "cuda", "--instances", "orchestrator=1"], 1),  # named: as given
    (["--device", "cuda", "--instances", "talker=2"], 2),        # another stage named: the default still holds
    (["--device", "cpu"], 1),                                    # the CPU path keeps one
])
def test_the_gpu_runs_two_orchestrator_instances_per_pipeline_unless_told(argv, orchestrators):
    placed = placement(cli.build_parser().parse_args(["serve", *argv]))
    assert placed.count("orchestrator") == orchestrators
    assert placed.orchestrator_instances == orchestrators * placed.pipelines
    assert placed.count("talker") == (2 if "talker=2" in argv else 1)


def test_pipeline_model_names_round_trip():
    from omni_triton.shared.placement import model_stage, pipeline_model

    assert pipeline_model("talker", 3, 4) == "talker_p3" and model_stage("talker_p3") == ("talker", 3)
    assert pipeline_model("talker", 0, 1) == "talker" and model_stage("talker") == ("talker", 0)
    assert pipeline_model("orchestrator", 1, 2) == "orchestrator" and model_stage("omni_p1") == ("omni_p1", 0)
    assert Placement(pipelines=2).models(1) == {"thinker": "thinker_p1", "talker": "talker_p1",
                                                "code2wav": "code2wav_p1"}


def test_each_orchestrator_instance_serves_the_pipeline_its_group_names():
    """Triton names an instance <group>_<index>: the orchestrator's groups are orchestrator_p<k>."""
    from omni_triton.shared.placement import orchestrator_instance

    assert orchestrator_instance("orchestrator_p0_0", 2) == (0, 0)
    assert orchestrator_instance("orchestrator_p3_1", 4) == (3, 1)
    assert orchestrator_instance("orchestrator_0_0", 1) == (0, 0)  # one instance: Triton's default group
    assert orchestrator_instance("orchestrator_p0_2", 1) == (0, 2)  # one pipeline, --instances orchestrator=3
    for name, pipelines in (("orchestrator_p2_0", 2), ("orchestrator_0_0", 2), ("orchestrator_p1", 2),
                            ("talker_0_0", 1)):
        with pytest.raises(ValueError, match=f"orchestrator instance '{name}' names none of {pipelines} pipelines"):
            orchestrator_instance(name, pipelines)


def test_each_pipeline_labels_its_stage_metrics(tiny_checkpoint, tmp_path):
    from omni_triton.stages.model_args import launch_settings, orchestrator_slot, replica_labels
    from server_fixture import stage_args

    out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, placement=Placement(
        instances={"talker": 2}, pipelines=2)), tmp_path / "cpu")
    talker = stage_args((out / "talker_p1" / "config.pbtxt").read_text(), "talker_p1")
    assert replica_labels(talker) == {"pipeline": "1", "model_instance": "talker_p1_0_0"}
    thinker = stage_args((out / "thinker_p0" / "config.pbtxt").read_text(), "thinker_p0")
    assert replica_labels(thinker) == {"pipeline": "0"}
    orchestrator = stage_args((out / "orchestrator" / "config.pbtxt").read_text(), "orchestrator")
    groups = json.loads(orchestrator["model_config"])["instance_group"]  # the text format parses as Triton's
    assert [(group["name"], group["count"], group["kind"]) for group in groups] == [
        ("orchestrator_p0", 1, "KIND_CPU"), ("orchestrator_p1", 1, "KIND_CPU")]
    assert orchestrator_slot(launch_settings(orchestrator), {**orchestrator, "model_instance_name":
                                                             "orchestrator_p1_0"}) == (
        1, OrchestratorSlot(index=0, per_pipeline=1, total=2), {"pipeline": "1"})


def test_orchestrator_instances_of_one_pipeline_are_told_apart(tiny_checkpoint, tmp_path):
    """--instances orchestrator=3: one group of three instances per pipeline, each with its own index, metric
    labels and a third of the pipeline's admission limits."""
    from omni_triton.stages.admission import split_limit
    from omni_triton.stages.model_args import launch_settings, orchestrator_slot
    from server_fixture import stage_args

    for pipelines in (1, 2):
        out = render_repository(LaunchConfig(checkpoint_dir=tiny_checkpoint, placement=Placement(
            instances={"orchestrator": 3}, pipelines=pipelines)), tmp_path / f"cpu{pipelines}")
        orchestrator = stage_args((out / "orchestrator" / "config.pbtxt").read_text(), "orchestrator")
        groups = json.loads(orchestrator["model_config"])["instance_group"]
        assert [(group["name"], group["count"]) for group in groups] == [
            (f"orchestrator_p{k}", 3) for k in range(pipelines)]
        settings = launch_settings(orchestrator)
        pipeline, slot, labels = orchestrator_slot(settings, {**orchestrator, "model_instance_name":
                                                              f"orchestrator_p{pipelines - 1}_2"})
        assert (pipeline, slot) == (pipelines - 1, OrchestratorSlot(index=2, per_pipeline=3, total=3 * pipelines))
        assert labels == {**({"pipeline": "1"} if pipelines == 2 else {}),
                          "model_instance": f"orchestrator_p{pipelines - 1}_2"}
    assert [split_limit(limit, 3) for limit in (64, 6, 1, 0)] == [22, 2, 1, 0]  # 0: no limit stays none


def test_pipelines_plan_each_gpu_as_a_whole_pipeline(full_footprint):
    one = plan_placement(full_footprint, {0: H200}, Placement(), code2wav_frames=97)
    two = plan_placement(full_footprint, {0: H200, 1: H200}, Placement(pipelines=2), code2wav_frames=97)
    first, second = two.gpus
    assert first.held == {"thinker": 1, "talker": 1, "code2wav": 1, "orchestrator": 1}
    assert second.held == {"thinker": 1, "talker": 1, "code2wav": 1, "orchestrator": 1}
    assert second.weight_bytes == first.weight_bytes == one.gpus[0].weight_bytes
    # GPU 1 holds pipeline 1's orchestrator instance: the same processes, so the same KV as GPU 0
    assert (two.thinker_tokens, two.talker_tokens) == (one.thinker_tokens, one.talker_tokens)


@pytest.mark.parametrize("argv, message", [
    (["--pipelines", "0"], "--pipelines 0: expected a count >= 1"),
    (["--device", "cuda", "--pipelines", "2", "--instances", "thinker=2"], "for more thinkers run whole pipelines"),
])
def test_serve_refuses_a_bad_pipeline_count(argv, message):
    args = cli.build_parser().parse_args(["serve", *argv])
    with pytest.raises(LaunchOptionError, match=re.escape(message)):
        placement(args)


def test_more_pipelines_than_gpus_are_refused_naming_the_option(full_footprint):
    with pytest.raises(DoesNotFit, match=re.escape("--pipelines 3 (1 GPU(s) each: 3 GPUs): GPU 2 is not visible "
                                                   "here (2 GPU(s): ids 0, 1)")):
        plan_placement(full_footprint, {0: H200, 1: H200}, Placement(pipelines=3))
    with pytest.raises(DoesNotFit, match=re.escape("--pipelines 2 (2 GPU(s) each: 4 GPUs): GPU 3 is not visible")):
        plan_placement(full_footprint, {0: H200, 1: H200, 2: H200}, Placement(gpus=SPLIT.gpus, pipelines=2))
