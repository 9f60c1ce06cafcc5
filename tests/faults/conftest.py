"""Fault-test fixtures: a Kafka broker, Redis server or S3 gateway a test may stop.

The worker processes of a test come from the ``workers`` fixture of tests/conftest.py;
the helpers (``LocalService`` among them) are ``producers.testing``'s and tests/harness.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.testing import free_port, free_ports
from tests.harness import LocalService

# SeaweedFS's filer, master and volume servers listen at these distances from its S3
# port, and each of those and the S3 port have a gRPC port 10000 higher (seaweedfs.sh).
_SEAWEEDFS_OFFSETS = tuple(n + grpc for n in (0, 555, 1000, -253) for grpc in (0, 10000))


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
