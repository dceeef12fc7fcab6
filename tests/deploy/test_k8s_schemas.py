"""deploy/k8s against the schemas the API server would apply: every built-in object validated strictly
(no unknown field anywhere) by kubernetes-validate, offline; KEDA's objects, for which it has no schema,
against the fields KEDA documents (keda.sh/docs/2.16: ScaledObject, TriggerAuthentication, the
redis-streams and the prometheus scalers), also with no unknown field."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.test_k8s import OBJECTS

# the oldest Kubernetes release the manifests promise (autoscaling/v2 is GA from 1.23) and the newest
# the installed kubernetes-validate knows
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
BUILT_IN = [obj for obj in OBJECTS if obj["kind"] not in KEDA_KINDS]


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object schema that refuses fields it does not name."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_METADATA = _closed(
    {"name": _STRING, "namespace": _STRING, "labels": {"type": "object"}, "annotations": {"type": "object"}},
    ("name",),
)
# the redis-streams scaler's metadata (all strings), and what a TriggerAuthentication may supply to it
REDIS_STREAMS_FIELDS = [
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "username",
    "usernameFromEnv",
    "password",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
]
REDIS_STREAMS_METADATA = _closed(dict.fromkeys(REDIS_STREAMS_FIELDS, _STRING), ("stream",))
# the prometheus scaler's metadata (all strings)
PROMETHEUS_FIELDS = [
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "timeout",
    "authModes",
]
PROMETHEUS_METADATA = _closed(dict.fromkeys(PROMETHEUS_FIELDS, _STRING), ("serverAddress", "query", "threshold"))
REDIS_AUTH_PARAMETERS = ("address", "host", "port", "username", "password", "tls", "ca", "cert", "key")
# the scalers these manifests use
TRIGGER_METADATA = {"redis-streams": REDIS_STREAMS_METADATA, "prometheus": PROMETHEUS_METADATA}


def _trigger(kind: str, metadata: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "type": {"const": kind},
            "name": _STRING,
            "metadata": metadata,
            "authenticationRef": _closed({"name": _STRING, "kind": _STRING}, ("name",)),
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "useCachedMetrics": _BOOL,
        },
        ("type", "metadata"),
    )


SCALED_OBJECT = _closed(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": _closed(
            {
                "scaleTargetRef": _closed(
                    {"name": _STRING, "apiVersion": _STRING, "kind": _STRING, "envSourceContainerName": _STRING},
                    ("name",),
                ),
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "fallback": {"type": "object"},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"oneOf": [_trigger(kind, metadata) for kind, metadata in TRIGGER_METADATA.items()]},
                },
            },
            ("scaleTargetRef", "triggers"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
TRIGGER_AUTHENTICATION = _closed(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": _METADATA,
        "spec": _closed(
            {
                "secretTargetRef": {
                    "type": "array",
                    "items": _closed(
                        {"parameter": {"enum": list(REDIS_AUTH_PARAMETERS)}, "name": _STRING, "key": _STRING},
                        ("parameter", "name", "key"),
                    ),
                },
                "env": {"type": "array"},
                "podIdentity": {"type": "object"},
            }
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
KEDA_SCHEMAS = {"ScaledObject": SCALED_OBJECT, "TriggerAuthentication": TRIGGER_AUTHENTICATION}


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("obj", BUILT_IN, ids=_name)
def test_built_in_objects_validate_strictly(obj: dict[str, Any], version: str):
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{_name(obj)} on Kubernetes {version}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("obj", [obj for obj in OBJECTS if obj["kind"] in KEDA_KINDS], ids=_name)
def test_keda_objects_use_only_documented_fields(obj: dict[str, Any]):
    jsonschema.validate(obj, KEDA_SCHEMAS[obj["kind"]])


def test_strict_validation_catches_a_misspelt_field():
    """The strict schemas are in force: a field Kubernetes does not know fails, as `kubectl apply
    --validate=strict` would."""
    (deployment,) = [obj for obj in BUILT_IN if obj["kind"] == "Deployment" and "gateway" in obj["metadata"]["name"]]
    misspelt = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[-1], strict=True)
    (scaled,) = [obj for obj in OBJECTS if obj["kind"] == "ScaledObject"]
    first, *others = scaled["spec"]["triggers"]
    trigger = {**first, "metadata": {**first["metadata"], "lenght": "5"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**scaled, "spec": {**scaled["spec"], "triggers": [trigger, *others]}}, SCALED_OBJECT)
