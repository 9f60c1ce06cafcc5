"""Fixtures of the scale-out tests: the clusters of `make up-cluster`, nodes a test may kill.

``kafka_cluster`` is the 3-broker KRaft cluster of compose/local/kafka-cluster.sh
(KAFKA_CLUSTER_PORT), ``redis_cluster`` the 3-primary Redis Cluster of
compose/local/redis-cluster.sh (REDIS_CLUSTER_PORT); ``redis_url`` stays the plain
Redis of REDIS_PORT. A test may kill or stop nodes: every test starts with every
node running and every partition fully replicated again, and the nodes it
stopped are started again after it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import SecretStr

from producers.settings import ClientSettings
from producers.testing import CLUSTER_SCHEME, Fleet, WorkerConfig, kafka_admin, plain_url, until
from tests.conftest import REPO, require_listening
from tests.harness import TEST_WORKER_OPTIONS

KAFKA_CLUSTER_PORT = int(os.environ.get("KAFKA_CLUSTER_PORT", "9292"))
REDIS_CLUSTER_PORT = int(os.environ.get("REDIS_CLUSTER_PORT", "7000"))
RUN_DIR = Path(os.environ.get("CONVEYOR_RUN_DIR", REPO / ".run"))
LOCAL = REPO / "compose" / "local"


def _script(script: str, *args: str) -> None:
    subprocess.run([str(LOCAL / script), *args], check=True, timeout=180)


@dataclass(frozen=True)
class KafkaCluster:
    """The local 3-broker cluster: node n serves clients on ``port + n - 1``."""

    port: int

    nodes = (1, 2, 3)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.port + n - 1}" for n in self.nodes)

    def pid(self, node: int) -> int:
        path = RUN_DIR / f"kafka-cluster-{self.port}" / f"node-{node}" / "kafka.pid"
        return int(path.read_text())

    def kill(self, node: int) -> None:
        """SIGKILL: a crash, no controlled shutdown."""
        _kill(self.pid(node))

    def stop(self, node: int) -> None:
        """SIGTERM: a controlled shutdown, leadership handed over first."""
        _script("kafka-cluster.sh", "stop", str(node))

    def start(self, node: int | None = None) -> None:
        """Start ``node`` (default: every node not running); returns once it is unfenced."""
        _script("kafka-cluster.sh", "start", *([str(node)] if node else []))

    async def leaders(self, topic: str) -> set[int]:
        """The brokers leading ``topic``'s partitions now."""
        async with kafka_admin(self.bootstrap) as admin:
            [described] = await admin.describe_topics([topic])
        return {p["leader"] for p in described["partitions"]}

    async def until_fully_replicated(self, timeout: float = 90) -> None:
        """Wait until every partition of every topic has all its replicas in sync:
        the step a rolling restart waits for before it stops the next broker."""
        lagging: list[str] = []

        async def in_sync() -> bool:
            lagging[:] = await self._under_replicated()
            return not lagging

        await until(in_sync, "every replica in sync", timeout, lambda: f"lagging: {lagging}")

    async def _under_replicated(self) -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            await admin.start()
            names = await admin.list_topics()
            described = await admin.describe_topics(list(names))
        except Exception as exc:  # the cluster is still settling: report it as lagging
            return [f"metadata: {exc!r}"]
        finally:
            await admin.close()
        return [
            f"{topic['topic']}[{p['partition']}] isr={p['isr']}"
            for topic in described
            for p in topic["partitions"]
            if len(p["isr"]) < len(p["replicas"]) or p["leader"] < 0
        ]


@dataclass(frozen=True)
class RedisClusterNodes:
    """The local Redis Cluster: node n listens on ``port + n - 1`` (3 primaries, 3 replicas)."""

    port: int

    nodes = (1, 2, 3, 4, 5, 6)

    @property
    def url(self) -> str:
        """The harness's name for it (see producers/testing/results.py)."""
        return f"{CLUSTER_SCHEME}://127.0.0.1:{self.port}/0"

    def node_of_port(self, port: int) -> int:
        return port - self.port + 1

    def pid(self, node: int) -> int:
        path = RUN_DIR / f"redis-cluster-{self.port}" / f"node-{node}" / "redis.pid"
        return int(path.read_text())

    def kill(self, node: int) -> None:
        """SIGKILL: a crash."""
        _kill(self.pid(node))

    def start(self, node: int | None = None) -> None:
        """Start ``node`` (default: every node not running); returns once the cluster serves
        with every replica linked."""
        _script("redis-cluster.sh", "start", *([str(node)] if node else []))


def _kill(pid: int) -> None:
    """SIGKILL ``pid``; returns once the kernel has closed its sockets (it is gone or a
    zombie)."""
    os.kill(pid, signal.SIGKILL)
    while Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "X"):
        time.sleep(0.05)  # polling the process table, not a wait for readiness


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


@pytest.fixture(scope="session")
def kafka_cluster() -> KafkaCluster:
    for n in KafkaCluster.nodes:
        require_listening(f"Kafka cluster node {n}", KAFKA_CLUSTER_PORT + n - 1)
    return KafkaCluster(KAFKA_CLUSTER_PORT)


@pytest.fixture(scope="session")
def redis_cluster_nodes() -> RedisClusterNodes:
    for n in RedisClusterNodes.nodes:
        require_listening(f"Redis Cluster node {n}", REDIS_CLUSTER_PORT + n - 1)
    return RedisClusterNodes(REDIS_CLUSTER_PORT)


@pytest.fixture
async def healthy_kafka(kafka_cluster: KafkaCluster) -> AsyncIterator[KafkaCluster]:
    """The Kafka cluster with every node up and in sync, before and after the test."""
    await asyncio.to_thread(kafka_cluster.start)
    await kafka_cluster.until_fully_replicated()
    yield kafka_cluster
    await asyncio.to_thread(kafka_cluster.start)


@pytest.fixture
def healthy_redis_cluster(redis_cluster_nodes: RedisClusterNodes) -> Iterator[RedisClusterNodes]:
    """The Redis Cluster with every node up, before and after the test."""
    redis_cluster_nodes.start()
    yield redis_cluster_nodes
    redis_cluster_nodes.start()


@pytest.fixture
def cluster_settings(healthy_redis_cluster: RedisClusterNodes) -> ClientSettings:
    """The SDK's settings for the Redis Cluster (the Kafka cluster is not needed)."""
    return ClientSettings(
        redis_url=SecretStr(plain_url(healthy_redis_cluster.url)),
        redis_cluster=True,
        connect_timeout_s=15,
    )


@pytest.fixture
def cluster_workers(
    kafka_cluster: KafkaCluster, redis_url: str, model_name: str, tmp_path: Path
) -> Iterator[Fleet]:
    """Workers of the test, on the Kafka cluster and the plain Redis by default."""
    base = WorkerConfig(model_name, kafka_cluster.bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    with Fleet(base, tmp_path) as fleet:
        yield fleet
