"""Fault-test fixtures: a Kafka broker, Redis server or S3 gateway a test may stop.

The worker processes of a test come from the ``workers`` fixture of tests/conftest.py;
the helpers are ``producers.testing``'s and tests/harness.py's.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from producers.testing import free_port, free_ports
from tests.conftest import REPO

_PORT_VARIABLE = {"kafka.sh": "KAFKA_PORT", "redis.sh": "REDIS_PORT", "seaweedfs.sh": "S3_PORT"}
# SeaweedFS's filer, master and volume servers listen at these distances from its S3
# port, and each of those and the S3 port have a gRPC port 10000 higher (seaweedfs.sh).
_SEAWEEDFS_OFFSETS = tuple(n + grpc for n in (0, 555, 1000, -253) for grpc in (0, 10000))


@dataclass
class LocalService:
    """A Kafka broker or Redis server of this test's own, started by compose/local scripts."""

    script: str
    port: int
    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    def _run(self, action: str) -> None:
        env = {
            **os.environ,
            "CONVEYOR_RUN_DIR": str(self.run_dir),
            _PORT_VARIABLE[self.script]: str(self.port),
            **self.env,
        }
        subprocess.run(
            [str(REPO / "compose" / "local" / self.script), action],
            env=env,
            check=True,
            timeout=180,
        )

    def start(self) -> None:
        self._run("start")

    def stop(self) -> None:
        self._run("stop")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def running(cls, script: str, port: int, run_dir: Path, **env: str) -> Iterator[LocalService]:
        """A fixture's body: the service started, yielded, stopped."""
        service = cls(script, port, run_dir, env)
        service.start()
        yield service
        service.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[LocalService]:
    # Snapshots on: a real deployment's Redis keeps its data across a restart.
    yield from LocalService.running("redis.sh", free_port(), tmp_path / "run", REDIS_SAVE="3600 1")


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[LocalService]:
    # The controller listens on port + 1.
    yield from LocalService.running("kafka.sh", free_ports((0, 1)), tmp_path / "run")


@pytest.fixture
def private_s3(tmp_path: Path) -> Iterator[LocalService]:
    """SeaweedFS of this test's own: its S3 port and the ports derived from it are free."""
    yield from LocalService.running(
        "seaweedfs.sh", free_ports(_SEAWEEDFS_OFFSETS), tmp_path / "run"
    )
