"""deploy/: every values file renders to the manifests checked in under deploy/k8s/, which validate against the
Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors), and whose server arguments are
the ones `omni-triton serve` takes and turns into the tritonserver command the probes and Service point at.

Not validated against a schema: the ServiceMonitor (a Prometheus Operator CRD; kubernetes-validate ships the
core API only; its selector and port are checked against the Service here instead) and kustomization.yaml
(kustomize's own file, not an API object; its resources are checked to exist)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from omni_triton import cli
from omni_triton.launch import deploy, serve
from omni_triton.launch.options import placement
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.launch.tritonserver import TritonInstall, TritonServer

ROOT = Path(__file__).resolve().parents[1]
VALUES = sorted((ROOT / "deploy" / "values").glob("*.yaml"))
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")  # an older and a recent cluster
NOT_IN_THE_CORE_SCHEMAS = {"ServiceMonitor", "Kustomization"}


def _documents(folder: Path) -> dict[str, list[dict]]:
    return {path.name: list(yaml.safe_load_all(path.read_text())) for path in sorted(folder.glob("*.yaml"))}


def _kind(documents: dict[str, list[dict]], kind: str, component: str = "triton") -> dict:
    found = [d for docs in documents.values() for d in docs
             if d["kind"] == kind and d["metadata"].get("labels", {}).get("app.kubernetes.io/component",
                                                                              component) == component]
    assert len(found) == 1, (kind, component, found)
    return found[0]


def test_there_are_overlays():
    assert {path.stem for path in VALUES} >= {"h200-one-gpu", "h200-split", "h200-replicas", "smoke-dummy",
                                              "h200-x4", "h200-x8", "h100-split"}
    assert {deploy.Values.load(path).gpus for path in VALUES} >= {1, 2, 4, 8}  # GPUs per pod (docs/scaling.md)


@pytest.mark.parametrize("values_path", VALUES, ids=lambda p: p.stem)
def test_checked_in_manifests_are_what_the_values_render(values_path, tmp_path):
    out = deploy.write(values_path, tmp_path / values_path.stem)
    checked_in = ROOT / "deploy" / "k8s" / values_path.stem
    rendered = {p.name: p.read_text() for p in out.iterdir()}
    assert rendered == {p.name: p.read_text() for p in checked_in.iterdir()}, (
        f"deploy/k8s/{values_path.stem} is stale: run omni-triton deploy deploy/values/{values_path.name}")


@pytest.mark.parametrize("values_path", VALUES, ids=lambda p: p.stem)
def test_every_manifest_validates_against_the_kubernetes_schemas(values_path):
    documents = _documents(ROOT / "deploy" / "k8s" / values_path.stem)
    skipped = set()
    for name, docs in documents.items():
        for document in docs:
            if document["kind"] in NOT_IN_THE_CORE_SCHEMAS:
                skipped.add(document["kind"])
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # still not a core kind
                    kubernetes_validate.validate(document, KUBERNETES_VERSIONS[-1], strict=True)
                continue
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(document, version, strict=True)  # raises ValidationError
    assert skipped == NOT_IN_THE_CORE_SCHEMAS
    kustomization = documents["kustomization.yaml"][0]
    assert set(kustomization["resources"]) <= set(documents) - {"kustomization.yaml"}
    assert "prometheus-adapter-rules.yaml" not in kustomization["resources"]  # it goes to the adapter's config


@pytest.mark.parametrize("values_path", VALUES, ids=lambda p: p.stem)
def test_rendered_server_arguments_are_what_serve_runs(values_path, tiny_checkpoint, tmp_path):
    values = deploy.Values.load(values_path)
    documents = _documents(ROOT / "deploy" / "k8s" / values_path.stem)
    deployment = _kind(documents, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["omni-triton"]
    args = cli.build_parser().parse_args(container["args"])  # serve's own parser takes them as they are
    assert args.handler is cli.cmd_serve and args.device == "cuda" and args.max_restarts == 0
    # the tritonserver command serve builds from them (the same two functions start_server calls)
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, device="cuda", placement=placement(args))
    options = serve.server_options(args, config)
    install = TritonInstall(binary=tmp_path / "tritonserver", backend_dir=tmp_path, lib_dirs=(), origin="explicit")
    install.__dict__["help_text"] = ""
    command = TritonServer(tmp_path, install, options).command()
    flags = dict(arg.split("=", 1) for arg in command[1:] if "=" in arg)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (int(flags["--http-port"]), int(flags["--grpc-port"]), int(flags["--metrics-port"])) == (
        ports["http"], ports["grpc"], ports["metrics"])
    assert flags["--http-address"] == flags["--grpc-address"] == flags["--metrics-address"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "http"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= \
        values.load_seconds
    # every GPU the placement uses exists in the pod, and each gets a CUDA memory pool
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    pools = [int(arg.split("=")[1].split(":")[0]) for arg in command if arg.startswith("--cuda-memory-pool")]
    assert pools == list(config.placement.used_gpus()) and max(pools) < gpus
    repository = render_repository(config, tmp_path / "repository", ["thinker", "talker", "code2wav"])
    for pipeline in range(config.placement.pipelines):
        for stage, model in config.placement.models(pipeline).items():
            text = (repository / model / "config.pbtxt").read_text()
            group = re.search(r"count: (\d+) kind: KIND_GPU gpus: \[ ([\d, ]+) \]", text)
            assert int(group.group(1)) == config.placement.count(stage)
            assert tuple(int(g) for g in group.group(2).split(",")) == config.placement.gpus_of(stage, pipeline)
    # /dev/shm is memory-backed
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    if args.checkpoint is not None:
        claim = volumes[mounts[deploy.CHECKPOINT_MOUNT]]["persistentVolumeClaim"]["claimName"]
        assert claim == values.checkpoint_claim and str(args.checkpoint).startswith(deploy.CHECKPOINT_MOUNT)


@pytest.mark.parametrize("values_path", VALUES, ids=lambda p: p.stem)
def test_service_monitor_hpa_and_adapter_rules_point_at_each_other(values_path):
    documents = _documents(ROOT / "deploy" / "k8s" / values_path.stem)
    service, monitor = _kind(documents, "Service"), _kind(documents, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    assert monitor["spec"]["endpoints"][0]["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert {port["name"] for port in service["spec"]["ports"]} == {"http", "grpc", "metrics"}
    hpa = next(d for d in documents["autoscaling.yaml"] if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _kind(documents, "Deployment")["metadata"]["name"]
    rules = yaml.safe_load(documents["prometheus-adapter-rules.yaml"][0]["data"]["rules.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    assert {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]} == served
    assert any("omni_active_requests" in rule["seriesQuery"] for rule in rules)  # a metric the stages export
    if "api.yaml" in documents:
        api = _kind(documents, "Deployment", component="api")["spec"]["template"]["spec"]["containers"][0]
        assert api["args"][0] == "api" and f"{service['metadata']['name']}:8001" in api["args"]


@pytest.mark.parametrize("change, message", [
    ({"serve": ["--stage-gpus", "thinker=0,talker=1"]}, r"uses GPU 1: set gpus: 2"),
    ({"serve": ["--pipelines", "2"]}, r"placement \(2 pipelines: .*\) uses GPU 1: set gpus: 2"),
    ({"serve": ["--instances", "thinker=2"]}, r"--instances thinker=2: only talker, code2wav, orchestrator"),
    ({"serve": ["--max-inflight", "many"]}, r"argument --max-inflight: invalid int value: 'many'"),
    ({"replicas": 3}, r"unknown key 'replicas'"),
    ({"checkpoint": {"claimName": "c", "path": "/data/ckpt"}}, r"checkpoint.path must be under /checkpoints/"),
    ({"checkpoint": None, "serve": []}, r"give checkpoint.claimName \+ checkpoint.path, or serve: \[--config"),
])
def test_values_serve_would_refuse_are_refused_by_name(change, message, tmp_path):
    raw = {**yaml.safe_load((ROOT / "deploy" / "values" / "h200-one-gpu.yaml").read_text()), **change}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(deploy.ValuesError, match=message):
        deploy.render(deploy.Values.load(path), str(path))


@pytest.mark.parametrize("values_path", VALUES, ids=lambda path: path.stem)
def test_rendered_api_arguments_are_what_the_api_takes(values_path):
    """The OpenAI API Deployment's arguments parse with `omni-triton api`'s own parser and reach this
    overlay's Triton Service over gRPC."""
    documents = [doc for docs in _documents(ROOT / "deploy" / "k8s" / values_path.stem).values() for doc in docs if doc]
    api = [doc for doc in documents if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-api")]
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}
    if not api:
        pytest.skip(f"{values_path.stem} deploys no API")
    container = api[0]["spec"]["template"]["spec"]["containers"][0]
    args = cli.build_parser().parse_args(container["args"])
    assert args.handler is cli.cmd_api
    host, port = args.triton_grpc.rsplit(":", 1)
    assert host in services, (host, list(services))
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"] if p["name"] == "grpc"]
    assert args.port == container["ports"][0]["containerPort"]
