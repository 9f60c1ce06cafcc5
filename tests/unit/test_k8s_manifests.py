"""compose/k8s/ holds what a Kubernetes deployment of workers relies on.

No cluster runs where the tests run, so these read the manifests: probes on the
health server's paths and port, a grace period long enough to drain, one GPU per
worker, a KEDA replica cap equal to the request topic's partitions, and
selectors that really select the worker pods.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import consumer_group, topics_for
from workers.health import DEFAULT_PORT
from workers.settings import WorkerSettings

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
def deployment(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return manifests["Deployment"]


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [worker] = deployment["spec"]["template"]["spec"]["containers"]
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


def test_selector_matches_the_pod_labels(deployment: dict[str, Any]) -> None:
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_replicas_are_left_to_keda(deployment: dict[str, Any]) -> None:
    assert "replicas" not in deployment["spec"]


def test_rollout_needs_no_spare_gpu(deployment: dict[str, Any]) -> None:
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxSurge"] == 0
    assert rolling["maxUnavailable"] == 1


def test_probes_hit_the_health_server(container: dict[str, Any]) -> None:
    [port] = container["ports"]
    assert port == {"name": "metrics", "containerPort": DEFAULT_PORT, "protocol": "TCP"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # A probe must outlast the server's own 2 s bound on readiness checks.
    assert container["readinessProbe"]["timeoutSeconds"] > 2


def test_scrape_annotations_name_the_metrics_port(deployment: dict[str, Any]) -> None:
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_grace_period_leaves_time_to_drain(deployment: dict[str, Any]) -> None:
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_one_gpu_per_worker(container: dict[str, Any]) -> None:
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert _env(container)["CONVEYOR_DEVICE"]["value"].startswith("cuda")


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
    assert service["selector"] == manifests["Deployment"]["spec"]["selector"]["matchLabels"]
    [port] = service["ports"]
    assert (port["port"], port["targetPort"]) == (DEFAULT_PORT, "metrics")


def _compose_partitions() -> int:
    """The request topic's partition count that docker-compose creates by default."""
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    default = compose["services"]["topics"]["environment"]["PARTITIONS"]
    match = re.fullmatch(r"\$\{CONVEYOR_PARTITIONS:-(\d+)\}", default)
    assert match, default
    return int(match.group(1))


def test_replica_cap_equals_partition_count(manifests: dict[str, dict[str, Any]]) -> None:
    scaled = manifests["ScaledObject"]
    documented = int(scaled["metadata"]["annotations"]["conveyor.dev/request-partitions"])
    assert scaled["spec"]["maxReplicaCount"] == documented == _compose_partitions()
    assert 1 <= scaled["spec"]["minReplicaCount"] <= documented


def test_keda_watches_the_workers_group_and_topic(
    manifests: dict[str, dict[str, Any]], container: dict[str, Any]
) -> None:
    scaled = manifests["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == manifests["Deployment"]["metadata"]["name"]
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
    deployment = manifests["Deployment"]["spec"]
    assert pdb["selector"]["matchLabels"] == deployment["selector"]["matchLabels"]
    assert pdb["selector"]["matchLabels"].items() <= (
        deployment["template"]["metadata"]["labels"].items()
    )
    assert pdb["maxUnavailable"] == 1
