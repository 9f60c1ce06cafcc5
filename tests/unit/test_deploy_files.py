"""Every deployment file under compose/ is checked against what will read it.

- Every Kubernetes object in every YAML file under compose/k8s/ (any number of
  files, folders and kinds) is validated against the Kubernetes API's own JSON
  schemas, strictly (an unknown or misspelt field fails), for the oldest and
  the newest Kubernetes release this project supports. Objects of the KEDA and
  prometheus-operator CRDs are checked against structural schemas written here
  from those projects' API references, and the HorizontalPodAutoscaler that KEDA
  derives from a ScaledObject against Kubernetes' own schema.
- References hold in every kustomization: each resource exists and each file is
  in a kustomization; selectors select something; a ScaledObject targets a
  workload that exists, of the kind it names; probes and ServiceMonitors name
  ports that exist; a StatefulSet's service exists.
- A CONVEYOR_* variable in any container or compose service is one the worker reads.
- docker-compose.yml: every file it names exists, every ${VARIABLE} has a
  default, the Dockerfile's COPY sources exist and its .dockerignore keeps them,
  and the broker and topics take records as large as the contract allows.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from schemas import DEFAULT_LIMITS
from workers.cli import ENVIRONMENT_ONLY, NESTED
from workers.config.worker import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
K8S_DIR = COMPOSE_DIR / "k8s"
KUSTOMIZATION = "kustomization.yaml"
# The oldest Kubernetes release the manifests support, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.latest_version())
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}


@dataclass(frozen=True)
class Manifest:
    path: Path
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.path.relative_to(ROOT)})"


def _documents(path: Path) -> list[Manifest]:
    return [Manifest(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]


ALL = [m for path in sorted(K8S_DIR.rglob("*.yaml")) for m in _documents(path)]
OBJECTS = [m for m in ALL if m.kind != "Kustomization"]
KUSTOMIZATIONS = sorted(path.parent for path in K8S_DIR.rglob(KUSTOMIZATION))


def _built(folder: Path) -> list[Manifest]:
    """The objects ``kubectl apply -k folder`` would apply (resources only; no patches)."""
    [kustomization] = _documents(folder / KUSTOMIZATION)
    assert set(kustomization.doc) <= {"apiVersion", "kind", "resources", "metadata"}, (
        f"{kustomization.path}: only plain resources are checked here; extend _built"
    )
    objects: list[Manifest] = []
    for resource in kustomization.doc["resources"]:
        target = (folder / resource).resolve()
        assert target.exists(), f"{kustomization.path}: resource {resource} does not exist"
        if target.is_dir():
            objects += _built(target)
        else:
            objects += _documents(target)
    return objects


def _pod_spec(manifest: Manifest) -> dict[str, Any] | None:
    spec = manifest.doc.get("spec", {})
    if manifest.kind == "Pod":
        return dict(spec)
    if manifest.kind == "CronJob":
        return dict(spec["jobTemplate"]["spec"]["template"]["spec"])
    if manifest.kind in WORKLOAD_KINDS:
        return dict(spec["template"]["spec"])
    return None


def _pod_labels(manifest: Manifest) -> dict[str, str]:
    spec = manifest.doc["spec"]
    if manifest.kind == "Pod":
        return dict(manifest.doc["metadata"].get("labels", {}))
    if manifest.kind == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["metadata"].get("labels", {}))


def _containers(manifest: Manifest) -> Iterator[dict[str, Any]]:
    pod = _pod_spec(manifest)
    if pod is not None:
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


# --- schemas of the custom resources ------------------------------------------------

_STRING = {"type": "string"}
_STRINGS = {"type": "array", "items": _STRING}
_STRING_MAP = {"type": "object", "additionalProperties": _STRING}
_COUNT = {"type": "integer", "minimum": 0}
_OBJECT = {"type": "object"}
_METADATA = {"type": "object", "required": ["name"]}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}},
}
_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}


def _strict(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": required or [],
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


# KEDA 2.x ScaledObject (keda.sh/v1alpha1), from KEDA's ScaledObject specification.
SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    _strict(
        {
            "scaleTargetRef": _strict(
                {
                    "apiVersion": _STRING,
                    "kind": _STRING,
                    "name": _STRING,
                    "envSourceContainerName": _STRING,
                },
                ["name"],
            ),
            "pollingInterval": _COUNT,
            "cooldownPeriod": _COUNT,
            "initialCooldownPeriod": _COUNT,
            "idleReplicaCount": _COUNT,
            "minReplicaCount": _COUNT,
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": _strict(
                {"failureThreshold": _COUNT, "replicas": _COUNT, "behavior": _STRING},
                ["failureThreshold", "replicas"],
            ),
            "advanced": _strict(
                {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": _strict(
                        {"name": _STRING, "behavior": _OBJECT}
                    ),
                    "scalingModifiers": _OBJECT,
                }
            ),
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": _strict(
                    {
                        "type": _STRING,
                        "name": _STRING,
                        "metadata": _STRING_MAP,  # KEDA rejects numbers and booleans here
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": _strict(
                            {
                                "name": _STRING,
                                "kind": {
                                    "enum": [
                                        "TriggerAuthentication",
                                        "ClusterTriggerAuthentication",
                                    ]
                                },
                            },
                            ["name"],
                        ),
                    },
                    ["type", "metadata"],
                ),
            },
        },
        ["scaleTargetRef", "triggers"],
    ),
)
# Metadata keys of KEDA's Kafka scaler: any other key is ignored by KEDA, silently.
KAFKA_TRIGGER_KEYS = {
    "bootstrapServers",
    "consumerGroup",
    "topic",
    "lagThreshold",
    "activationLagThreshold",
    "offsetResetPolicy",
    "allowIdleConsumers",
    "excludePersistentLag",
    "scaleToZeroOnInvalidOffset",
    "limitToPartitionsWithLag",
    "ensureEvenDistributionOfPartitions",
    "partitionLimitation",
    "version",
    "sasl",
    "tls",
    "unsafeSsl",
}

# prometheus-operator ServiceMonitor (monitoring.coreos.com/v1), from its API reference.
SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _strict(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _strict({"any": {"type": "boolean"}, "matchNames": _STRINGS}),
            "jobLabel": _STRING,
            "targetLabels": _STRINGS,
            "podTargetLabels": _STRINGS,
            "sampleLimit": _COUNT,
            "targetLimit": _COUNT,
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _strict(
                    {
                        "port": _STRING,
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                        "params": _OBJECT,
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                        "tlsConfig": _OBJECT,
                        "authorization": _OBJECT,
                        "basicAuth": _OBJECT,
                        "bearerTokenSecret": _OBJECT,
                        "followRedirects": {"type": "boolean"},
                        "enableHttp2": {"type": "boolean"},
                        "filterRunning": {"type": "boolean"},
                    }
                ),
            },
        },
        ["selector", "endpoints"],
    ),
)
CUSTOM_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}


# --- Kubernetes objects -------------------------------------------------------------


def test_there_are_manifests_to_check() -> None:
    kinds = {m.kind for m in OBJECTS}
    assert kinds & WORKLOAD_KINDS, "no worker workload under compose/k8s"
    assert {"ScaledObject", "Service", "PodDisruptionBudget", "ServiceMonitor"} <= kinds
    assert K8S_DIR in KUSTOMIZATIONS


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", OBJECTS, ids=str)
def test_object_is_valid_for_its_schema(manifest: Manifest, version: str) -> None:
    key = (manifest.doc.get("apiVersion"), manifest.doc.get("kind"))
    if key in CUSTOM_SCHEMAS:
        jsonschema.Draft202012Validator(CUSTOM_SCHEMAS[key]).validate(manifest.doc)
        return
    try:
        kubernetes_validate.validate(manifest.doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"{manifest}: no Kubernetes schema; a custom resource needs CUSTOM_SCHEMAS")
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{manifest} is invalid for Kubernetes {version}: {exc.message}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_autoscaler_keda_derives_is_valid(version: str) -> None:
    for scaled in (m for m in OBJECTS if m.kind == "ScaledObject"):
        spec = scaled.doc["spec"]
        target = spec["scaleTargetRef"]
        hpa: dict[str, Any] = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{scaled.name}"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": target.get("apiVersion", "apps/v1"),
                    "kind": target.get("kind", "Deployment"),
                    "name": target["name"],
                },
                "minReplicas": max(1, spec.get("minReplicaCount", 0)),
                "maxReplicas": spec.get("maxReplicaCount", 100),
            },
        }
        config = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
        if "behavior" in config:
            hpa["spec"]["behavior"] = config["behavior"]
        kubernetes_validate.validate(hpa, version, strict=True)
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], str(scaled)


def test_kafka_triggers_use_only_keys_keda_reads() -> None:
    for scaled in (m for m in OBJECTS if m.kind == "ScaledObject"):
        for trigger in scaled.doc["spec"]["triggers"]:
            if trigger["type"] == "kafka":
                unknown = trigger["metadata"].keys() - KAFKA_TRIGGER_KEYS
                assert not unknown, f"{scaled}: KEDA would ignore {sorted(unknown)}"


# --- references between objects -----------------------------------------------------


def test_every_file_is_in_a_kustomization() -> None:
    listed: set[Path] = set()
    for folder in KUSTOMIZATIONS:
        [kustomization] = _documents(folder / KUSTOMIZATION)
        listed |= {(folder / r).resolve() for r in kustomization.doc["resources"]}
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        if path.name != KUSTOMIZATION:
            assert path.resolve() in listed, f"{path.relative_to(ROOT)} is in no kustomization"


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_hold_in_each_kustomization(folder: Path) -> None:
    objects = _built(folder)
    names = [(m.kind, m.name) for m in objects]
    assert len(names) == len(set(names)), f"{folder}: an object is applied twice"
    workloads = [m for m in objects if m.kind in WORKLOAD_KINDS]
    services = {m.name: m for m in objects if m.kind == "Service"}
    for manifest in objects:
        spec = manifest.doc.get("spec", {})
        if manifest.kind in WORKLOAD_KINDS - {"Pod", "CronJob"}:
            assert _selects(spec["selector"], _pod_labels(manifest)), str(manifest)
        if manifest.kind == "StatefulSet":
            assert spec["serviceName"] in services, f"{manifest}: no Service {spec['serviceName']}"
        if manifest.kind in ("Service", "PodDisruptionBudget"):
            selector = spec["selector"]
            if manifest.kind == "Service":
                selector = {"matchLabels": selector}
            assert any(_selects(selector, _pod_labels(w)) for w in workloads), (
                f"{manifest} selects no pods"
            )
        if manifest.kind == "ScaledObject":
            target = spec["scaleTargetRef"]
            kind = target.get("kind", "Deployment")  # KEDA's default
            assert (kind, target["name"]) in names, f"{manifest}: no {kind} {target['name']}"
        if manifest.kind == "ServiceMonitor":
            selected = [s for s in services.values() if _selects(spec["selector"], _labels_of(s))]
            assert selected, f"{manifest} selects no Service"
            ports = {p.get("name") for s in selected for p in s.doc["spec"]["ports"]}
            for endpoint in spec["endpoints"]:
                assert endpoint["port"] in ports, f"{manifest}: no Service port {endpoint['port']}"


def _labels_of(manifest: Manifest) -> dict[str, str]:
    return dict(manifest.doc["metadata"].get("labels", {}))


def test_probes_name_container_ports() -> None:
    for manifest in OBJECTS:
        for container in _containers(manifest):
            ports = container.get("ports", [])
            named = {p["name"] for p in ports if "name" in p}
            numbers = {p["containerPort"] for p in ports}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None:
                    assert port in (named if isinstance(port, str) else numbers), (
                        f"{manifest}: {probe} port {port} is no port of {container['name']}"
                    )


def _conveyor_variables() -> set[str]:
    names = {f"CONVEYOR_{name.upper()}" for name in WorkerSettings.model_fields}
    for name, model in NESTED.items():
        names |= {f"CONVEYOR_{name.upper()}__{field.upper()}" for field in model.model_fields}
    return names | set(ENVIRONMENT_ONLY)


def test_containers_set_only_variables_the_worker_reads() -> None:
    known = _conveyor_variables()
    for manifest in OBJECTS:
        for container in _containers(manifest):
            for item in container.get("env", []):
                name = item["name"]
                if name.startswith("CONVEYOR_"):
                    assert name in known, f"{manifest}: the worker ignores {name}"


# --- docker compose ------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    return document


def test_compose_names_only_files_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = COMPOSE_DIR / build["context"]
            assert context.is_dir(), name
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):  # a bind mount, not a named volume
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"
        for env_file in service.get("env_file", []):
            assert (COMPOSE_DIR / env_file).is_file(), f"{name}: {env_file} does not exist"


def test_compose_variables_have_defaults() -> None:
    text = (COMPOSE_DIR / "docker-compose.yml").read_text()
    for match in re.finditer(r"(?<!\$)\$\{([^}]+)\}", text):
        assert ":-" in match.group(1), f"${{{match.group(1)}}} needs a default (:-)"


def test_compose_services_set_only_variables_the_worker_reads(compose: dict[str, Any]) -> None:
    known = _conveyor_variables()
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        keys = [item.split("=", 1)[0] for item in env] if isinstance(env, list) else list(env)
        for key in keys:
            if key.startswith("CONVEYOR_"):
                assert key in known, f"{name}: the worker ignores {key}"


def test_dockerfile_copies_files_that_exist_and_are_not_ignored(compose: dict[str, Any]) -> None:
    build = compose["services"]["worker"]["build"]
    context = COMPOSE_DIR / build["context"]
    dockerfile = context / build["dockerfile"]
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    ignored = [
        line.strip()
        for line in ignore_file.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    copies = [shlex.split(line)[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (context / source).exists(), f"COPY {source}: no such file in the context"
            assert not any(fnmatch.fnmatch(source.rstrip("/"), p) for p in ignored), source


def test_compose_kafka_and_topics_take_the_largest_request(compose: dict[str, Any]) -> None:
    needed = DEFAULT_LIMITS.max_record_bytes
    kafka = compose["services"]["kafka"]["environment"]
    assert int(kafka["KAFKA_MESSAGE_MAX_BYTES"]) >= needed
    script = "\n".join(compose["services"]["topics"]["command"])
    assert f"--config max.message.bytes={needed}" in script
