"""deploy/k8s, checked offline: every object is well formed, selectors match pod labels, what one
object references (Secrets and their keys, claims, scale targets, trigger auth) exists, workers ask
for a GPU and probe their heartbeat, and KEDA watches every stream the worker's model is queued on."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gateway.metrics import GatewayMetrics
from shared import keys
from shared.schema import Priority
from tests.deploy.conftest import DEPLOY, parse_lorafleet_args

K8S = DEPLOY / "k8s"
REQUIRED_SPEC = {
    "Deployment": ("selector", "template"),
    "Service": ("selector", "ports"),
    "HorizontalPodAutoscaler": ("scaleTargetRef", "minReplicas", "maxReplicas", "metrics"),
    "PersistentVolumeClaim": ("accessModes", "resources"),
    "ScaledObject": ("scaleTargetRef", "triggers"),
    "TriggerAuthentication": ("secretTargetRef",),
}
API_VERSIONS = {
    "Namespace": "v1",
    "Secret": "v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    "Deployment": "apps/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "ScaledObject": "keda.sh/v1alpha1",
    "TriggerAuthentication": "keda.sh/v1alpha1",
}


def load_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return objects


OBJECTS = load_objects()


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in OBJECTS if obj["kind"] == kind}


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def secret_refs(deployment: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for container in containers(deployment):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                yield ref["name"], ref["key"]


def secret_keys(name: str) -> set[str]:
    secret = of_kind("Secret")[name]
    return set(secret.get("stringData", {})) | set(secret.get("data", {}))


def worker_args(deployment: dict[str, Any]) -> list[str]:
    (container,) = containers(deployment)
    return [arg.replace("$(POD_NAME)", "pod-0") for arg in container["args"]]


WORKERS = {
    name: obj
    for name, obj in of_kind("Deployment").items()
    if obj["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
}


def test_there_is_something_to_check():
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ScaledObject", "Secret"} <= {
        o["kind"] for o in OBJECTS
    }
    assert WORKERS


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{o.get('kind')}/{o.get('metadata', {}).get('name')}")
def test_every_object_is_well_formed_and_in_the_namespace(obj: dict[str, Any]):
    assert obj["apiVersion"] == API_VERSIONS[obj["kind"]]
    assert obj["metadata"]["name"]
    if obj["kind"] != "Namespace":
        assert obj["metadata"]["namespace"] in of_kind("Namespace")
    for field in REQUIRED_SPEC.get(obj["kind"], ()):
        assert field in obj["spec"], f"{obj['kind']} {obj['metadata']['name']} has no spec.{field}"


@pytest.mark.parametrize("name", sorted(of_kind("Deployment")))
def test_deployment_selectors_match_their_pod_labels(name: str):
    deployment = of_kind("Deployment")[name]
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()


@pytest.mark.parametrize("name", sorted(of_kind("Service")))
def test_services_select_a_deployments_pods_on_a_named_port(name: str):
    service = of_kind("Service")[name]
    matched = [
        d
        for d in of_kind("Deployment").values()
        if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(matched) == 1, f"Service {name} selects {len(matched)} Deployments"
    ports = {port["name"] for container in containers(matched[0]) for port in container.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports


@pytest.mark.parametrize("name", sorted(of_kind("Deployment")))
def test_referenced_secrets_and_claims_exist(name: str):
    deployment = of_kind("Deployment")[name]
    for secret, key in secret_refs(deployment):
        assert key in secret_keys(secret), f"{name} reads {secret}/{key}, which no manifest defines"
    volumes = deployment["spec"]["template"]["spec"].get("volumes", [])
    claims = {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    assert claims <= of_kind("PersistentVolumeClaim").keys()
    for container in containers(deployment):
        mounted = {mount["name"] for mount in container.get("volumeMounts", [])}
        assert mounted <= {v["name"] for v in volumes}
        assert "REDIS_URL" in {env["name"] for env in container.get("env", [])}, f"{name} has no REDIS_URL"


@pytest.mark.parametrize("kind", ["HorizontalPodAutoscaler", "ScaledObject"])
def test_autoscalers_target_existing_deployments(kind: str):
    for name, scaler in of_kind(kind).items():
        assert scaler["spec"]["scaleTargetRef"]["name"] in of_kind("Deployment"), f"{kind} {name}"


def test_the_gateway_runs_a_valid_command_probes_http_and_scales_on_cpu():
    gateway = of_kind("Deployment")["lorafleet-gateway"]
    (container,) = containers(gateway)
    assert parse_lorafleet_args(container["args"]).command == "gateway"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "cpu" in container["resources"]["requests"], "a CPU-utilisation HPA needs a CPU request"
    assert gateway["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_workers_run_a_valid_command_ask_for_a_gpu_and_probe_their_heartbeat(name: str):
    deployment = WORKERS[name]
    (container,) = containers(deployment)
    args = parse_lorafleet_args(worker_args(deployment))
    assert args.command == "worker" and args.device == "cuda"
    assert args.worker_id == "pod-0", "the probe finds the worker by its pod name"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (model,) = args.model
    assert deployment["metadata"]["labels"]["lorafleet.io/model"] == model.name
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"] == ["lorafleet-worker-health"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.drain_grace, "the pod is killed before the worker's drain ends"


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_workers_serve_metrics_on_the_port_their_pods_announce_for_scraping(name: str):
    deployment = WORKERS[name]
    (container,) = containers(deployment)
    args = parse_lorafleet_args(worker_args(deployment))
    assert args.metrics_port > 0 and args.metrics_host == "0.0.0.0", "Prometheus scrapes the pod's address"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["metrics"] == args.metrics_port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"


# the interactive trigger's query: the largest of the gateways' (equal) counts of all the class's streams
QUEUE_DEPTH_QUERY = re.compile(r'max\((?P<metric>\w+)\{model="(?P<model>[^"]+)",priority="(?P<priority>\w+)"\}\)')


def triggers_of(name: str) -> dict[str, dict[str, Any]]:
    """The ScaledObject of worker Deployment `name`: its triggers by type."""
    (scaled,) = [s for s in of_kind("ScaledObject").values() if s["spec"]["scaleTargetRef"]["name"] == name]
    assert scaled["spec"]["minReplicaCount"] >= 1, "keep one worker warm: loading a model takes minutes"
    triggers = {trigger["type"]: trigger for trigger in scaled["spec"]["triggers"]}
    assert len(triggers) == len(scaled["spec"]["triggers"]), "one trigger per type"
    return triggers


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_keda_scales_each_worker_on_its_models_batch_stream(name: str):
    (model,) = parse_lorafleet_args(worker_args(WORKERS[name])).model
    trigger = triggers_of(name)["redis-streams"]
    assert trigger["metadata"]["stream"] == keys.queue(model.name, Priority.BATCH)  # never routed: the whole class
    assert trigger["metadata"]["consumerGroup"] == keys.WORKER_GROUP
    assert int(trigger["metadata"]["streamLength"]) >= 1
    auth = of_kind("TriggerAuthentication")[trigger["authenticationRef"]["name"]]
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["key"] in secret_keys(ref["name"])
    assert {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]} >= {"address"}


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_keda_scales_each_worker_on_every_stream_of_its_models_interactive_jobs(name: str):
    """Routed jobs wait on one stream per worker beside the shared one: the trigger reads the gateway's
    sum of them all, a series the gateway really exports under those labels."""
    (model,) = parse_lorafleet_args(worker_args(WORKERS[name])).model
    triggers = triggers_of(name)
    query = QUEUE_DEPTH_QUERY.fullmatch(triggers["prometheus"]["metadata"]["query"])
    assert query is not None, triggers["prometheus"]["metadata"]["query"]
    assert (query["model"], query["priority"]) == (model.name, Priority.INTERACTIVE.value)
    metrics = GatewayMetrics()
    metrics.queue_depth.labels(model.name, Priority.INTERACTIVE.value).set(3)
    assert metrics.registry.get_sample_value(query["metric"], {"model": model.name, "priority": "interactive"}) == 3
    assert triggers["prometheus"]["metadata"]["ignoreNullValues"] == "false"  # a lost target is no empty queue
    # batch work scales out more slowly: a worker takes more batch jobs than interactive ones before another is due
    interactive = float(triggers["prometheus"]["metadata"]["threshold"])
    assert 1 <= interactive < int(triggers["redis-streams"]["metadata"]["streamLength"])
