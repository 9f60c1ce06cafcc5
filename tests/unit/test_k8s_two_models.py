"""compose/k8s-two-models/ serves two models from one host file on the workers of
compose/k8s/: what its patches say must agree with the host file the worker reads, the
base they patch and the names the worker derives (no cluster or kustomize runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import consumer_group, topics_for
from workers.config.host import HostFile, read_host_file
from workers.config.worker import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "compose" / "k8s"
OVERLAY = ROOT / "compose" / "k8s-two-models"


def _load(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(path.read_text())
    return found


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return _load(OVERLAY / "kustomization.yaml")


@pytest.fixture(scope="module")
def patches(kustomization: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The overlay's patches, by kind."""
    return {
        doc["kind"]: doc for doc in (_load(OVERLAY / p["path"]) for p in kustomization["patches"])
    }


@pytest.fixture(scope="module")
def host() -> HostFile:
    found = read_host_file(OVERLAY / "host.toml", set(WorkerSettings.model_fields))
    assert found is not None, "host.toml has no [[models]] tables"
    return found


def _base(kind: str) -> dict[str, Any]:
    for path in sorted(BASE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == kind:
                found: dict[str, Any] = doc
                return found
    raise AssertionError(f"no {kind} in {BASE}")


def test_the_overlay_patches_the_workers_of_compose_k8s(
    kustomization: dict[str, Any], patches: dict[str, dict[str, Any]]
) -> None:
    assert (OVERLAY / kustomization["resources"][0]).resolve() == BASE
    listed = {p["path"] for p in kustomization["patches"]}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
    for kind, patch in patches.items():
        assert patch["metadata"]["name"] == _base(kind)["metadata"]["name"]


def test_the_pods_read_the_host_file_from_the_config_map(
    kustomization: dict[str, Any], patches: dict[str, dict[str, Any]], host: HostFile
) -> None:
    assert len(host.models) == 2
    [generated] = kustomization["configMapGenerator"]
    assert generated["files"] == ["host.toml"]
    spec = patches["StatefulSet"]["spec"]["template"]["spec"]
    [container] = spec["containers"]
    command = container["command"]
    path = Path(command[command.index("--config-file") + 1])
    [volume] = spec["volumes"]
    assert volume["configMap"]["name"] == generated["name"]
    [mount] = container["volumeMounts"]
    assert mount["name"] == volume["name"]
    assert path.parent == Path(mount["mountPath"])
    assert path.name == "host.toml"


def test_what_a_host_file_forbids_beside_it_is_taken_out_of_the_base(
    patches: dict[str, dict[str, Any]],
) -> None:
    """The base sets CONVEYOR_MODEL, which a host file does not allow beside it."""
    [base] = _base("StatefulSet")["spec"]["template"]["spec"]["containers"]
    [patch] = patches["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    deleted = {e["name"] for e in patch["env"] if e.get("$patch") == "delete"}
    assert "CONVEYOR_MODEL" in {e["name"] for e in base["env"]}
    assert deleted == {"CONVEYOR_MODEL", "CONVEYOR_PROCESSES"}


def test_keda_has_a_trigger_for_each_model_of_the_host_file(
    patches: dict[str, dict[str, Any]], host: HostFile
) -> None:
    triggers = patches["ScaledObject"]["spec"]["triggers"]
    [env] = _base("StatefulSet")["spec"]["template"]["spec"]["containers"]
    bootstrap = {e["name"]: e.get("value") for e in env["env"]}["CONVEYOR_KAFKA_BOOTSTRAP"]
    watched = {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in triggers}
    assert watched == {(consumer_group(m.name), topics_for(m.name).requests) for m in host.models}
    for trigger in triggers:
        assert trigger["type"] == "kafka"
        assert trigger["metadata"]["bootstrapServers"] == bootstrap
        assert all(isinstance(value, str) for value in trigger["metadata"].values())


def test_each_request_topic_has_a_partition_for_every_process(
    patches: dict[str, dict[str, Any]], host: HostFile
) -> None:
    partitions = int(
        patches["ScaledObject"]["metadata"]["annotations"]["conveyor.dev/request-partitions"]
    )
    pods = _base("ScaledObject")["spec"]["maxReplicaCount"]
    for model in host.models:
        assert pods * int(model.table["processes"]) == partitions
