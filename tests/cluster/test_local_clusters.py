"""compose/local/kafka-cluster.sh and redis-cluster.sh: the readiness and stop semantics of up.sh.

Against the running clusters of `make up-cluster`: a second start changes nothing,
and each node's readiness check passes. With a run folder and ports of the
test's own: a port in use fails fast naming the port and the log, and stop with
nothing running touches nothing. No second cluster is started (three JVMs).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.testing import free_ports
from tests.cluster.conftest import LOCAL, RUN_DIR, KafkaCluster, RedisClusterNodes


def _run(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LOCAL / script), *args],
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _ready(service: str, port: str, *options: str) -> subprocess.CompletedProcess[str]:
    argv = ["python3", str(LOCAL / "ready.py"), service, "127.0.0.1", port, *options]
    return subprocess.run(
        [*argv, "--timeout", "30"], capture_output=True, text=True, timeout=60, check=False
    )


def _pids(pattern: str) -> set[str]:
    return {path.read_text() for path in RUN_DIR.glob(pattern)}


def test_second_start_of_the_kafka_cluster_changes_nothing(kafka_cluster: KafkaCluster) -> None:
    pattern = f"kafka-cluster-{kafka_cluster.port}/node-*/kafka.pid"
    before = _pids(pattern)
    again = _run("kafka-cluster.sh", "start")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already running") == 3
    assert _pids(pattern) == before
    status = _run("kafka-cluster.sh", "status")
    assert status.returncode == 0
    assert status.stdout.count("running pid") == 3
    for node in kafka_cluster.nodes:
        port = str(kafka_cluster.port + node - 1)
        ready = _ready("kafka", port, "--brokers", "3")
        assert ready.returncode == 0, ready.stderr


def test_second_start_of_the_redis_cluster_changes_nothing(
    redis_cluster_nodes: RedisClusterNodes,
) -> None:
    pattern = f"redis-cluster-{redis_cluster_nodes.port}/node-*/redis.pid"
    before = _pids(pattern)
    again = _run("redis-cluster.sh", "start")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already running") == 6
    assert _pids(pattern) == before
    for node in redis_cluster_nodes.nodes:
        port = str(redis_cluster_nodes.port + node - 1)
        ready = _ready("redis-cluster", port, "--replicas", "1")
        assert ready.returncode == 0, ready.stderr


@pytest.fixture
def private(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment with a run folder of the test's own and free base ports."""
    env = dict(os.environ)
    env.update(
        CONVEYOR_RUN_DIR=str(tmp_path / "run"),
        KAFKA_CLUSTER_PORT=str(free_ports(range(6))),
        REDIS_CLUSTER_PORT=str(free_ports([*range(6), *range(10000, 10006)])),  # + cluster bus
        READY_TIMEOUT="20",
    )
    yield env
    _run("kafka-cluster.sh", "stop", env=env)
    _run("redis-cluster.sh", "stop", env=env)


KAFKA_NODE_2_LOG = "kafka-cluster-{base}/node-2/logs/server.log"


@pytest.mark.parametrize(
    ("script", "variable", "offset", "log"),
    [
        ("kafka-cluster.sh", "KAFKA_CLUSTER_PORT", 1, KAFKA_NODE_2_LOG),
        ("kafka-cluster.sh", "KAFKA_CLUSTER_PORT", 4, KAFKA_NODE_2_LOG),
        ("redis-cluster.sh", "REDIS_CLUSTER_PORT", 2, "redis-cluster-{base}/node-3/redis.log"),
        ("redis-cluster.sh", "REDIS_CLUSTER_PORT", 10002, "redis-cluster-{base}/node-3/redis.log"),
    ],
)
def test_port_in_use_fails_fast_naming_port_and_log(
    private: dict[str, str], script: str, variable: str, offset: int, log: str
) -> None:
    base = int(private[variable])
    port = base + offset  # node 2's broker or controller port, node 3's port or bus port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        result = _run(script, "start", env=private)
    assert result.returncode != 0
    error = result.stderr[result.stderr.index("ERROR") :].strip()
    assert f"port {port}" in error
    assert variable in error
    assert str(Path(private["CONVEYOR_RUN_DIR"]) / log.format(base=base)) in error
    # Nothing was started: every port is checked before the first node starts.
    assert not list(Path(private["CONVEYOR_RUN_DIR"]).glob("*/node-*/*.pid"))


@pytest.mark.parametrize("script", ["kafka-cluster.sh", "redis-cluster.sh"])
def test_stop_with_nothing_running_touches_nothing(private: dict[str, str], script: str) -> None:
    result = _run(script, "stop", env=private)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert not Path(private["CONVEYOR_RUN_DIR"]).exists()
