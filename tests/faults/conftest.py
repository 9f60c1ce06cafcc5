"""Fault-test fixtures: services a test may stop, and the workers of a test.

Every scenario produces N requests, injects its fault, and records a row of
produced / answered / lost / duplicate-visible with ``tally`` in the table
printed at the end of the run (and written to .run/fault-report.txt). The
helpers live in tests/integration/harness.py, shared with tests/cluster; the
fault tests import them from here.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from demo.models.digits import build_digits_model, heldout_digits
from tests.integration.harness import (
    REPO,
    Workers,
    admin_for,
    check,
    free_port,
    tally,
    until_answered,
)
from tests.integration.harness import setup_model as setup

__all__ = ["LocalService", "Workers", "admin_for", "check", "setup", "tally", "until_answered"]


_PORT_VARIABLE = {"kafka.sh": "KAFKA_PORT", "redis.sh": "REDIS_PORT", "seaweedfs.sh": "S3_PORT"}


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


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[LocalService]:
    # Snapshots on: a real deployment's Redis keeps its data across a restart.
    service = LocalService("redis.sh", free_port(), tmp_path / "run", {"REDIS_SAVE": "3600 1"})
    service.start()
    yield service
    service.stop()


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[LocalService]:
    # The controller listens on port + 1: pick a port whose neighbour is free too.
    while True:
        port = free_port()
        try:
            socket.create_connection(("127.0.0.1", port + 1), timeout=0.2).close()
        except OSError:
            break
    service = LocalService("kafka.sh", port, tmp_path / "run")
    service.start()
    yield service
    service.stop()


@pytest.fixture
def private_s3(tmp_path: Path) -> Iterator[LocalService]:
    """SeaweedFS of this test's own: its S3 port and the ports derived from it are free."""
    while True:
        port = free_port()
        derived = (port + 555, port + 1000, port - 253)
        wanted = [*derived, *(p + 10000 for p in derived)]
        if all(1024 < p < 65536 and not _listening(p) for p in wanted):
            break
    service = LocalService("seaweedfs.sh", port, tmp_path / "run")
    service.start()
    yield service
    service.stop()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def digits() -> list[tuple[bytes, int]]:
    build_digits_model()
    return heldout_digits()


@pytest.fixture
def workers(
    kafka_bootstrap: str, redis_url: str, model_name: str, tmp_path: Path
) -> Iterator[Workers]:
    group = Workers(model_name, kafka_bootstrap, redis_url, tmp_path)
    yield group
    group.stop_all()
