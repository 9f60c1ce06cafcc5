"""compose/k8s/ holds what a Kubernetes deployment of workers relies on.

No cluster runs where the tests run, so these read the manifests: probes on the
health server's paths and port, a grace period long enough to drain, one GPU per
pod shared by its worker processes, static group membership under stable pod
names, a KEDA replica cap that leaves a partition for every process, and
selectors that really select the worker pods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import consumer_group, topics_for
from workers.config.worker import DEFAULT_METRICS_PORT as DEFAULT_PORT
from workers.config.worker import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "compose" / "k8s"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    """Every manifest, by kind (one object of each kind is expected)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in by_kind, f"second {doc['kind']} in {path.name}"
            by_kind[doc["kind"]] = doc
    return by_kind


@pytest.fixture(scope="module")
def workers(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The StatefulSet of the worker pods."""
    return manifests["StatefulSet"]


@pytest.fixture(scope="module")
def container(workers: dict[str, Any]) -> dict[str, Any]:
    [worker] = workers["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = worker
    return found


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container["env"]}


def _model(container: dict[str, Any]) -> str:
    return str(_env(container)["CONVEYOR_MODEL"]["value"])


def test_kustomization_lists_every_manifest(manifests: dict[str, dict[str, Any]]) -> None:
    listed = set(manifests["Kustomization"]["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    for kind, doc in manifests.items():
        if kind != "Kustomization":
            assert doc["apiVersion"], kind
            assert doc["metadata"]["name"], kind


def test_selector_matches_the_pod_labels(workers: dict[str, Any]) -> None:
    selector = workers["spec"]["selector"]["matchLabels"]
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_replicas_are_left_to_keda(workers: dict[str, Any]) -> None:
    assert "replicas" not in workers["spec"]


def test_rollout_replaces_one_pod_at_a_time(workers: dict[str, Any]) -> None:
    spec = workers["spec"]
    # A StatefulSet replaces a pod only after deleting it (no surge pod needing a
    # spare GPU), one at a time unless maxUnavailable says otherwise.
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["updateStrategy"].get("rollingUpdate", {}).get("maxUnavailable", 1) == 1
    # Scaling out starts every new pod at once rather than in ordinal order.
    assert spec["podManagementPolicy"] == "Parallel"


def test_static_membership_under_the_pod_name(
    workers: dict[str, Any], container: dict[str, Any]
) -> None:
    env = _env(container)
    instance = env["CONVEYOR_GROUP_INSTANCE_ID"]["valueFrom"]["fieldRef"]
    assert instance["fieldPath"] == "metadata.name"  # stable across restarts: a StatefulSet
    assert workers["kind"] == "StatefulSet"
    # The group must wait out a pod's restart: at least the time the startup probe
    # allows for the model to load, plus the drain before it.
    startup = container["startupProbe"]
    startup_s = startup["periodSeconds"] * startup["failureThreshold"]
    session_ms = int(env["CONVEYOR_SESSION_TIMEOUT_MS"]["value"])
    assert session_ms >= startup_s * 1000
    # WorkerSettings accepts the value (and the broker's default maximum is 30 min).
    assert WorkerSettings(model="digits", session_timeout_ms=session_ms).session_timeout_ms
    assert session_ms <= 1_800_000


def test_pods_are_named_through_the_headless_service(
    manifests: dict[str, dict[str, Any]], workers: dict[str, Any]
) -> None:
    service = manifests["Service"]
    assert workers["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"


def test_probes_hit_the_health_server(container: dict[str, Any]) -> None:
    [port] = container["ports"]
    assert port == {"name": "metrics", "containerPort": DEFAULT_PORT, "protocol": "TCP"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # A probe must outlast the server's own 2 s bound on readiness checks.
    assert container["readinessProbe"]["timeoutSeconds"] > 2


def test_scrape_annotations_name_the_metrics_port(workers: dict[str, Any]) -> None:
    annotations = workers["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_grace_period_leaves_time_to_drain(workers: dict[str, Any]) -> None:
    assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_one_gpu_per_pod_shared_by_its_processes(container: dict[str, Any]) -> None:
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    env = _env(container)
    assert env["CONVEYOR_DEVICE"]["value"].startswith("cuda")
    assert int(env["CONVEYOR_PROCESSES"]["value"]) > 1  # the supervisor and its MPS server
    assert env.get("CONVEYOR_MPS", {"value": "auto"})["value"] == "auto"


def test_configured_by_real_settings_only(container: dict[str, Any]) -> None:
    env = _env(container)
    fields = {f"CONVEYOR_{name.upper()}" for name in WorkerSettings.model_fields}
    assert env.keys() <= fields  # a misspelt variable would be silently ignored
    assert env["CONVEYOR_METRICS_PORT"]["value"] == str(DEFAULT_PORT)
    assert env["CONVEYOR_LOG_FORMAT"]["value"] == "json"
    # A --model flag in the command would override CONVEYOR_MODEL.
    assert not any(arg.startswith("--model") for arg in container["command"])


def test_redis_credentials_come_from_a_secret(container: dict[str, Any]) -> None:
    redis = _env(container)["CONVEYOR_REDIS_URL"]
    assert "value" not in redis
    assert set(redis["valueFrom"]["secretKeyRef"]) == {"name", "key"}


def test_service_exposes_metrics_of_each_pod(manifests: dict[str, dict[str, Any]]) -> None:
    service = manifests["Service"]["spec"]
    assert service["clusterIP"] == "None"  # headless: scrape pods one by one
    assert service["selector"] == manifests["StatefulSet"]["spec"]["selector"]["matchLabels"]
    [port] = service["ports"]
    assert (port["port"], port["targetPort"]) == (DEFAULT_PORT, "metrics")


def test_replica_cap_times_processes_equals_partition_count(
    manifests: dict[str, dict[str, Any]], container: dict[str, Any]
) -> None:
    """Every worker process of every pod is a member of the group: the request topic
    needs a partition for each, and no more pods than that may start."""
    scaled = manifests["ScaledObject"]
    documented = int(scaled["metadata"]["annotations"]["conveyor.dev/request-partitions"])
    processes = int(_env(container)["CONVEYOR_PROCESSES"]["value"])
    assert scaled["spec"]["maxReplicaCount"] * processes == documented
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_keda_watches_the_workers_group_and_topic(
    manifests: dict[str, dict[str, Any]], container: dict[str, Any]
) -> None:
    scaled = manifests["ScaledObject"]["spec"]
    target = scaled["scaleTargetRef"]
    workload = manifests["StatefulSet"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        workload["apiVersion"],
        workload["kind"],
        workload["metadata"]["name"],
    )
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    model = _model(container)
    assert meta["consumerGroup"] == consumer_group(model)
    assert meta["topic"] == topics_for(model).requests
    bootstrap = _env(container)["CONVEYOR_KAFKA_BOOTSTRAP"]["value"]
    assert meta["bootstrapServers"] == bootstrap
    assert int(meta["lagThreshold"]) > 0
    assert meta["allowIdleConsumers"] == "false"
    # KEDA reads trigger metadata as strings; a bare number or boolean is rejected.
    assert all(isinstance(value, str) for value in meta.values())


def test_disruption_budget_covers_the_workers(manifests: dict[str, dict[str, Any]]) -> None:
    pdb = manifests["PodDisruptionBudget"]["spec"]
    workload = manifests["StatefulSet"]["spec"]
    assert pdb["selector"]["matchLabels"] == workload["selector"]["matchLabels"]
    assert pdb["selector"]["matchLabels"].items() <= (
        workload["template"]["metadata"]["labels"].items()
    )
    assert pdb["maxUnavailable"] == 1
