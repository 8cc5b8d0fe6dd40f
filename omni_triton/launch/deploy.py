"""Kubernetes manifests for the served pipeline, from one values file: `omni-triton deploy VALUES --out DIR`.

No helm binary installs here, and a strategic-merge renderer of our own would be a second kustomize; instead
each overlay is a small values file (deploy/values/*.yaml) and this module writes plain manifests for it plus a
kustomization.yaml (deploy/k8s/<overlay>/: `kubectl apply -k` takes it as it is). The pod runs `omni-triton
serve` with the values' options: the container arguments are parsed here by serve's own parser and launch
code (placement, ports), so a manifest with options `serve` would refuse is never written, and the probes,
Service and GPU count are taken from what serve will run. What is written:

- triton.yaml: Deployment (the image of docker/Dockerfile: NGC tritonserver + this repository), with a
  memory-backed /dev/shm (the Python backend's stubs exchange tensors there; the container default is 64 MiB),
  startup/readiness probes on /v2/health/ready and liveness on /v2/health/live sized by ``loadSeconds``, the GPUs
  the placement uses; and its Service (http, grpc, metrics).
- monitoring.yaml: a ServiceMonitor (Prometheus Operator) scraping the metrics port.
- autoscaling.yaml: an autoscaling/v2 HPA on two per-pod metrics that prometheus-adapter serves (rules in
  prometheus-adapter-rules.yaml, which goes into the adapter's own config, not into this kustomization):
  streams in flight (the orchestrator's ``omni_active_requests``) and Triton's queue:compute time of code2wav.
- api.yaml: the OpenAI-compatible API (`omni-triton api`) as a second Deployment + Service in front of Triton.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HTTP_PORT, GRPC_PORT, METRICS_PORT, API_PORT = 8000, 8001, 8002, 9000
RUN_DIR = "/var/run/omni-triton"  # rendered repository and server log: an emptyDir
CHECKPOINT_MOUNT = "/checkpoints"
PROBE_PERIOD_S = 10
# what the HPA scales on (prometheus-adapter names them; prometheus-adapter-rules.yaml defines them)
STREAMS_METRIC = "omni_streams_in_flight"
QUEUE_METRIC = "triton_code2wav_queue_compute_ratio"
KUSTOMIZED = ("triton.yaml", "monitoring.yaml", "autoscaling.yaml", "api.yaml")


class ValuesError(ValueError):
    """A values file that cannot be rendered; the message names the file, the key and the value."""


@dataclass(frozen=True)
class Values:
    """One overlay: the keys of a deploy/values/*.yaml file (camelCase there, as in Kubernetes)."""

    name: str
    image: str
    gpus: int                                  # nvidia.com/gpu per pod
    serve: tuple[str, ...] = ()                # more `omni-triton serve` options (placement, limits, ...)
    checkpoint_claim: str | None = None        # a PersistentVolumeClaim holding the checkpoint ...
    checkpoint_path: str | None = None         # ... and the checkpoint dir in it (under /checkpoints)
    namespace: str | None = None
    image_pull_policy: str = "IfNotPresent"
    shm_size: str = "16Gi"
    cpu: str = "16"
    memory: str = "128Gi"
    load_seconds: int = 1800                   # startup probe budget: weights load + CUDA graph capture
    node_selector: dict[str, str] = field(default_factory=dict)
    min_replicas: int = 1
    max_replicas: int = 4
    streams_per_pod: int = 8                   # HPA target: average streams in flight per pod
    queue_compute_ratio: str = "1"             # HPA target: code2wav queue time / compute time per pod
    api_replicas: int = 0                      # 0: no API deployment
    api_args: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: str | Path) -> "Values":
        path = Path(path)
        raw = yaml.safe_load(path.read_text()) or {}
        known = {"name", "namespace", "image", "imagePullPolicy", "gpus", "serve", "checkpoint", "shmSize",
                 "resources", "loadSeconds", "nodeSelector", "autoscaling", "api"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValuesError(f"{path}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
        for key in ("name", "image", "gpus"):
            if key not in raw:
                raise ValuesError(f"{path}: {key} is required")
        checkpoint, resources = raw.get("checkpoint") or {}, raw.get("resources") or {}
        scaling, api = raw.get("autoscaling") or {}, raw.get("api") or {}
        if bool(checkpoint.get("claimName")) != bool(checkpoint.get("path")):
            raise ValuesError(f"{path}: checkpoint needs claimName and path together, got {checkpoint}")
        values = cls(
            name=raw["name"], image=raw["image"], gpus=int(raw["gpus"]), namespace=raw.get("namespace"),
            serve=tuple(str(option) for option in raw.get("serve") or ()),
            checkpoint_claim=checkpoint.get("claimName"), checkpoint_path=checkpoint.get("path"),
            image_pull_policy=raw.get("imagePullPolicy", cls.image_pull_policy),
            shm_size=str(raw.get("shmSize", cls.shm_size)), cpu=str(resources.get("cpu", cls.cpu)),
            memory=str(resources.get("memory", cls.memory)),
            load_seconds=int(raw.get("loadSeconds", cls.load_seconds)), node_selector=raw.get("nodeSelector") or {},
            min_replicas=int(scaling.get("minReplicas", cls.min_replicas)),
            max_replicas=int(scaling.get("maxReplicas", cls.max_replicas)),
            streams_per_pod=int(scaling.get("streamsPerPod", cls.streams_per_pod)),
            queue_compute_ratio=str(scaling.get("queueComputeRatio", cls.queue_compute_ratio)),
            api_replicas=int(api.get("replicas", 0)), api_args=tuple(str(a) for a in api.get("args") or ()))
        if values.checkpoint_path and not values.checkpoint_path.startswith(CHECKPOINT_MOUNT + "/"):
            raise ValuesError(f"{path}: checkpoint.path must be under {CHECKPOINT_MOUNT}/ (where claimName is "
                              f"mounted), got {values.checkpoint_path!r}")
        if not 1 <= values.min_replicas <= values.max_replicas:
            raise ValuesError(f"{path}: autoscaling needs 1 <= minReplicas <= maxReplicas, got "
                              f"{values.min_replicas}, {values.max_replicas}")
        return values


def serve_arguments(values: Values) -> list[str]:
    """The container's arguments: `omni-triton serve` on the pod's GPUs, every port on all addresses (the pod's
    own network), no restarts of its own (Kubernetes restarts the container), then the values' options."""
    source = (["--checkpoint", values.checkpoint_path] if values.checkpoint_path else [])
    return ["serve", *source, "--device", "cuda", "--host", "0.0.0.0", "--http-port", str(HTTP_PORT),
            "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT), "--max-restarts", "0",
            "--run-dir", RUN_DIR, *values.serve]


def checked_serve(values: Values, source: str = "values") -> tuple[argparse.Namespace, Any]:
    """``serve_arguments`` parsed by serve's own parser, and the tritonserver options serve builds from them
    (``serve.server_options``). Raises ValuesError for options serve refuses or GPUs the pod does not have."""
    from omni_triton.launch.options import LaunchOptionError, placement
    from omni_triton.launch.serve import add_serve_arguments, server_options
    from omni_triton.shared.settings import LaunchConfig

    serve = argparse.ArgumentParser(prog="omni-triton serve")
    add_serve_arguments(serve)
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):  # argparse prints why it exits: that is the message
            args = serve.parse_args(serve_arguments(values)[1:])
        if args.checkpoint is None and args.config is None:
            raise LaunchOptionError("give checkpoint.claimName + checkpoint.path, or serve: [--config NAME]")
        placed = placement(args)
    except SystemExit:
        raise ValuesError(f"{source}: serve {' '.join(values.serve)}: "
                          f"{refusal.getvalue().strip().splitlines()[-1]}") from None
    except LaunchOptionError as error:
        raise ValuesError(f"{source}: serve {' '.join(values.serve)}: {error}") from None
    needed = max(placed.used_gpus()) + 1
    if needed > values.gpus:
        raise ValuesError(f"{source}: gpus {values.gpus}, but the placement ({placed.describe()}) uses GPU "
                          f"{needed - 1}: set gpus: {needed}")
    config = LaunchConfig(checkpoint_dir=Path("."), device="cuda", placement=placed)
    return args, server_options(args, config)


def render(values: Values, source: str = "values") -> dict[str, list[dict]]:
    """file name -> its documents."""
    args, options = checked_serve(values, source)
    labels = {"app.kubernetes.io/name": "omni-triton", "app.kubernetes.io/instance": values.name}
    triton_labels = {**labels, "app.kubernetes.io/component": "triton"}
    files = {"triton.yaml": [_deployment(values, triton_labels, options), _service(values, triton_labels)],
             "monitoring.yaml": [_service_monitor(values, triton_labels)],
             "autoscaling.yaml": [_hpa(values, labels)],
             "prometheus-adapter-rules.yaml": [_adapter_rules(values, labels)]}
    if values.api_replicas:
        api_labels = {**labels, "app.kubernetes.io/component": "api"}
        files["api.yaml"] = [_api_deployment(values, api_labels), _api_service(values, api_labels)]
    files["kustomization.yaml"] = [{"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                    **({"namespace": values.namespace} if values.namespace else {}),
                                    "resources": [name for name in KUSTOMIZED if name in files]}]
    return files


def _metadata(values: Values, name: str, labels: dict) -> dict:
    return {"name": name, "labels": dict(labels), **({"namespace": values.namespace} if values.namespace else {})}


def _http_probe(path: str, failures: int, period_s: int = PROBE_PERIOD_S) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _deployment(values: Values, labels: dict, options) -> dict:
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": values.shm_size}},
               {"name": "run", "emptyDir": {}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "run", "mountPath": RUN_DIR}]
    if values.checkpoint_claim:
        volumes.append({"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": values.checkpoint_claim, "readOnly": True}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT, "readOnly": True})
    container = {
        "name": "triton", "image": values.image, "imagePullPolicy": values.image_pull_policy,
        "command": ["omni-triton"], "args": serve_arguments(values),
        "ports": [{"name": "http", "containerPort": options.http_port},
                  {"name": "grpc", "containerPort": options.grpc_port},
                  {"name": "metrics", "containerPort": options.metrics_port}],
        # startup: the load (weights, graph capture) may take loadSeconds; then ready/live are checked often
        "startupProbe": _http_probe("/v2/health/ready", -(-values.load_seconds // PROBE_PERIOD_S)),
        "readinessProbe": _http_probe("/v2/health/ready", 3, period_s=5),
        "livenessProbe": _http_probe("/v2/health/live", 6),
        "resources": {"requests": {"cpu": values.cpu, "memory": values.memory, "nvidia.com/gpu": values.gpus},
                      "limits": {"memory": values.memory, "nvidia.com/gpu": values.gpus}},
        "volumeMounts": mounts,
    }
    pod = {"containers": [container], "volumes": volumes,
           # serve stops tritonserver on SIGTERM: Triton drains in-flight streams, then unloads
           "terminationGracePeriodSeconds": 60,
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    if values.node_selector:
        pod["nodeSelector"] = dict(values.node_selector)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(values, values.name, labels),
            "spec": {"replicas": values.min_replicas, "selector": {"matchLabels": dict(labels)},
                     # a new pod must load (minutes) and be ready before an old one goes
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": {"metadata": {"labels": dict(labels)}, "spec": pod}}}


def _service(values: Values, labels: dict) -> dict:
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
             for name, port in (("http", HTTP_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT))]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(values, values.name, labels),
            "spec": {"selector": dict(labels), "ports": ports}}


def _service_monitor(values: Values, labels: dict) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _metadata(values, values.name, labels),
            "spec": {"selector": {"matchLabels": dict(labels)},
                     # short interval: the HPA's rate() windows need several samples per minute
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "5s"}]}}


def _hpa(values: Values, labels: dict) -> dict:
    def pods_metric(name: str, target: str) -> dict:
        return {"type": "Pods", "pods": {"metric": {"name": name},
                                         "target": {"type": "AverageValue", "averageValue": target}}}

    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _metadata(values, values.name, labels),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": values.name},
                     "minReplicas": values.min_replicas, "maxReplicas": values.max_replicas,
                     "metrics": [pods_metric(STREAMS_METRIC, str(values.streams_per_pod)),
                                 pods_metric(QUEUE_METRIC, values.queue_compute_ratio)],
                     # a new pod takes minutes to load: add one as soon as the load calls for it, take one
                     # away only after ten quiet minutes
                     "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0,
                                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
                                  "scaleDown": {"stabilizationWindowSeconds": 600,
                                                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]}}}}


def _adapter_rules(values: Values, labels: dict) -> dict:
    """prometheus-adapter's custom-metrics rules for the HPA's two metrics, as a ConfigMap to merge into the
    adapter's config (its Helm chart: ``rules.custom``). Per pod, so the HPA averages over the pods."""
    pod = {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
    # the pod's streams: the sum of its orchestrator series (one, or with serve --pipelines one per pipeline, each
    # labelled pipeline), and a pipeline's vocoder is the model code2wav_p<k>
    code2wav = 'model=~"code2wav(_p[0-9]+)?"'
    rules = [
        {"seriesQuery": 'omni_active_requests{stage="orchestrator",namespace!="",pod!=""}', "resources": pod,
         "name": {"matches": "^omni_active_requests$", "as": STREAMS_METRIC},
         "metricsQuery": 'sum(<<.Series>>{<<.LabelMatchers>>,stage="orchestrator"}) by (<<.GroupBy>>)'},
        {"seriesQuery": f'nv_inference_queue_duration_us{{{code2wav},namespace!="",pod!=""}}', "resources": pod,
         "name": {"matches": "^nv_inference_queue_duration_us$", "as": QUEUE_METRIC},
         "metricsQuery": (f'sum(rate(nv_inference_queue_duration_us{{<<.LabelMatchers>>,{code2wav}}}[1m])) '
                          'by (<<.GroupBy>>) / clamp_min(sum(rate(nv_inference_compute_infer_duration_us'
                          f'{{<<.LabelMatchers>>,{code2wav}}}[1m])) by (<<.GroupBy>>), 1)')},
    ]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(values, f"{values.name}-adapter-rules", labels),
            "data": {"rules.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False, width=200)}}


def api_arguments(values: Values) -> list[str]:
    return list(values.api_args) or ["api", "--host", "0.0.0.0", "--port", str(API_PORT),
                                     "--triton-grpc", f"{values.name}:{GRPC_PORT}"]


def _api_deployment(values: Values, labels: dict) -> dict:
    container = {"name": "api", "image": values.image, "imagePullPolicy": values.image_pull_policy,
                 "command": ["omni-triton"], "args": api_arguments(values),
                 "ports": [{"name": "http", "containerPort": API_PORT}],
                 "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
                 "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(values, f"{values.name}-api", labels),
            "spec": {"replicas": values.api_replicas, "selector": {"matchLabels": dict(labels)},
                     "template": {"metadata": {"labels": dict(labels)}, "spec": {"containers": [container]}}}}


def _api_service(values: Values, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(values, f"{values.name}-api", labels),
            "spec": {"selector": dict(labels),
                     "ports": [{"name": "http", "port": API_PORT, "targetPort": "http", "protocol": "TCP"}]}}


HEADER = "# Rendered from deploy/values/{values} by `omni-triton deploy`: edit that file and render again.\n"


def write(values_path: Path, out_dir: Path) -> Path:
    """Render ``values_path`` into ``out_dir`` (replacing the files it writes); returns ``out_dir``."""
    files = render(Values.load(values_path), str(values_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, documents in files.items():
        header = HEADER.format(values=values_path.name)
        (out_dir / name).write_text(header + yaml.safe_dump_all(copy.deepcopy(documents), sort_keys=False,
                                                                width=120))
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="omni-triton deploy",
                                     description="write Kubernetes manifests (+ kustomization.yaml) for values files")
    parser.add_argument("values", nargs="+", type=Path, help="deploy/values/*.yaml")
    parser.add_argument("--out", type=Path, default=Path("deploy/k8s"),
                        help="one folder per values file goes here, named after the file (default: %(default)s)")
    args = parser.parse_args(argv)
    for values_path in args.values:
        try:
            out = write(values_path, args.out / values_path.stem)
        except ValuesError as error:
            print(f"omni-triton deploy: {error}", file=sys.stderr)
            return 1
        print(f"{values_path} -> {out}/")
    return 0
