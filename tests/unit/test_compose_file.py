"""compose/docker-compose.yml says what users with Docker rely on.

Docker does not run where the tests run, so these read the file itself: the
services, Kafka's KRaft settings, a worker that `--scale worker=N` can multiply,
configuration through CONVEYOR_* variables only, start-up ordered by health,
a Prometheus that scrapes every worker replica, and a Grafana with the workers'
dashboard over it (the dashboard itself: tests/unit/test_grafana_dashboard.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import topics_for
from workers.config.host import read_host_file
from workers.config.worker import DEFAULT_METRICS_PORT as DEFAULT_PORT
from workers.config.worker import WorkerSettings

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    document = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    found: dict[str, Any] = document["services"]
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    """The environment of a service, written as a mapping or as a KEY=VALUE list."""
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _listeners(value: str) -> dict[str, str]:
    """'NAME://host:port,...' as {NAME: 'host:port'}."""
    return dict(item.split("://", 1) for item in value.split(","))


def test_services(services: dict[str, Any]) -> None:
    assert {"kafka", "redis", "worker", "prometheus", "grafana"} <= services.keys()
    assert services["kafka"]["image"] == "apache/kafka:4.1.1"
    assert services["redis"]["image"] == "redis:7"


def test_kafka_is_a_single_kraft_node(services: dict[str, Any]) -> None:
    env = _env(services["kafka"])
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    controller = _listeners(env["KAFKA_LISTENERS"])[env["KAFKA_CONTROLLER_LISTENER_NAMES"]]
    controller_port = controller.rsplit(":", 1)[1]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node_id}@kafka:{controller_port}"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", key


def test_kafka_reachable_from_containers_and_host(services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    env = _env(kafka)
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocol_map = env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    protocols = dict(item.split(":") for item in protocol_map.split(","))
    by_address = {address: name for name, address in advertised.items()}
    # Other containers: kafka:9092 on the listener bound to the container's 9092.
    inside = by_address["kafka:9092"]
    assert listeners[inside].endswith(":9092")
    # The host: localhost:9092, published to the container port of that listener.
    outside = by_address["localhost:9092"]
    container_port = listeners[outside].rsplit(":", 1)[1]
    published = [str(p).rsplit(":", 2)[-2:] for p in kafka["ports"]]
    assert ["9092", container_port] in published
    assert protocols[inside] == protocols[outside] == "PLAINTEXT"


def test_worker_can_be_scaled(services: dict[str, Any]) -> None:
    worker = services["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker
    assert worker["build"] == {"context": "..", "dockerfile": "compose/Dockerfile.worker"}
    assert (COMPOSE_DIR / "Dockerfile.worker").is_file()


def test_worker_configured_by_conveyor_variables_only(services: dict[str, Any]) -> None:
    env = _env(services["worker"])
    assert env == {
        "CONVEYOR_KAFKA_BOOTSTRAP": "kafka:9092",
        "CONVEYOR_REDIS_URL": "redis://redis:6379/0",
        "CONVEYOR_MODEL": "digits",
    }
    # Every variable is a real setting: a misspelt one would be silently ignored.
    fields = {f"CONVEYOR_{name.upper()}" for name in WorkerSettings.model_fields}
    assert env.keys() <= fields


def test_healthchecks_and_start_order(services: dict[str, Any]) -> None:
    for name in ("kafka", "redis"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] in {"CMD", "CMD-SHELL"}
    assert "kafka:9092" in services["kafka"]["healthcheck"]["test"]
    depends = services["worker"]["depends_on"]
    assert depends["kafka"] == {"condition": "service_healthy"}
    assert depends["redis"] == {"condition": "service_healthy"}
    assert depends["topics"] == {"condition": "service_completed_successfully"}


def test_topics_service_creates_the_workers_topics(services: dict[str, Any]) -> None:
    topics = services["topics"]
    assert topics["depends_on"]["kafka"] == {"condition": "service_healthy"}
    script = "\n".join(topics["command"])
    created = set(re.findall(r"conveyor\.digits\.\w+", script))  # and worker-gpu's model
    expected = topics_for("digits")
    assert created == {expected.requests, expected.results, expected.dlq}
    assert "--if-not-exists" in script


def test_the_gpu_worker_runs_the_one_command_on_every_card(services: dict[str, Any]) -> None:
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]  # only with `docker compose --profile gpu up`
    env = _env(gpu)
    assert env.keys() <= {f"CONVEYOR_{name.upper()}" for name in WorkerSettings.model_fields}
    assert env["CONVEYOR_DEVICE"] == "cuda"
    assert "CONVEYOR_PROCESSES" not in env  # auto: eight a card, a supervisor and MPS
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["count"]) == ("nvidia", "all")
    assert "CONVEYOR_MODEL" not in env  # the models are the host file's
    command = gpu["command"]
    assert command[:2] == ["conveyor", "worker"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in gpu["volumes"] if v.startswith("./")}
    host = COMPOSE_DIR / mounted[command[command.index("--config-file") + 1]]
    found = read_host_file(host, set(WorkerSettings.model_fields))
    assert found is not None
    assert [m.name for m in found.models] == ["resnet50", "embeddings"]
    script = "\n".join(services["topics"]["command"])
    assert "conveyor.{resnet50,embeddings}.{requests,results,dlq}" in script
    partitions = _env(services["topics"])["GPU_PARTITIONS"]
    assert re.fullmatch(r"\$\{CONVEYOR_GPU_PARTITIONS:-8\}", partitions)


def test_redis_keeps_results_in_an_append_only_file(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "${REDIS_APPENDONLY:-yes}"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert command[command.index("--save") + 1] == ""
    # On a named volume, so the file outlives the container.
    assert "redis-data:/data" in redis["volumes"]
    document = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    assert "redis-data" in document["volumes"]


def test_dockerfile_installs_the_worker_extra() -> None:
    dockerfile = (COMPOSE_DIR / "Dockerfile.worker").read_text()
    assert re.search(r"^FROM python:3\.12-slim$", dockerfile, re.MULTILINE)
    [extras] = re.findall(r"^RUN pip install '\.\[([a-z0-9,]+)\]'$", dockerfile, re.MULTILINE)
    # The demo extra trains the model it serves while the image is built; the others are
    # what a worker may be asked to use: payloads in S3, traces, timm models, int8 layers.
    assert set(extras.split(",")) == {"worker", "demo", "s3", "tracing", "timm", "quant"}
    assert 'CMD ["conveyor", "worker", "--model", "digits"]' in dockerfile


def test_prometheus_scrapes_every_worker_replica(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"])  # pinned
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    # The worker's metrics port is reachable inside the network, not published.
    assert str(DEFAULT_PORT) in [str(port) for port in services["worker"]["expose"]]

    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "conveyor-worker"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    [discovery] = job["dns_sd_configs"]
    # DNS service discovery of the compose service: one A record per replica.
    assert discovery["names"] == ["worker", "worker-gpu"]
    assert discovery["type"] == "A"
    assert discovery["port"] == DEFAULT_PORT
    assert "static_configs" not in job  # a fixed target list would miss scaled replicas


def test_grafana_shows_the_dashboard_over_prometheus(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])  # pinned
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]  # loopback: anonymous viewers only
    assert "prometheus" in grafana["depends_on"]
    env = _env(grafana)
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert all(v.endswith(":ro") for v in grafana["volumes"])
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, _, name = home.rpartition("/")
    assert (COMPOSE_DIR / mounts[folder] / name).is_file()
    assert (COMPOSE_DIR / mounts["/etc/grafana/provisioning"] / "datasources").is_dir()
