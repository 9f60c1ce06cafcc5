"""Fault-test fixtures: count what each scenario lost, and services a test may stop.

Every scenario produces N requests, injects its fault, and records a row of
produced / answered / lost / duplicate-visible in the table printed at the end
of the run (and written to .run/fault-report.txt).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient

from schemas import OutgoingRecord, result_key, topics_for
from tests.integration.harness import (
    REPO,
    WorkerProcess,
    count_results,
    create_model_topics,
    digit_requests,
    read_topic,
    wait_for_results,
)
from workers.demo_model import build_digits_model, heldout_digits


@dataclass(frozen=True)
class Row:
    scenario: str
    produced: int
    answered: int
    lost: int
    duplicate_visible: int  # ids whose answer differs between Redis and reply records
    redelivered: int  # ids answered more than once on the reply topic (same bytes)

    def line(self) -> str:
        return (
            f"| {self.scenario:<46} | {self.produced:>8} | {self.answered:>8} | "
            f"{self.lost:>4} | {self.duplicate_visible:>17} | {self.redelivered:>11} |"
        )


ROWS: list[Row] = []
HEADER = (
    f"| {'scenario':<46} | {'produced':>8} | {'answered':>8} | {'lost':>4} | "
    f"{'duplicate-visible':>17} | {'redelivered':>11} |"
)


async def tally(
    scenario: str,
    bootstrap: str,
    redis_url: str,
    model: str,
    ids: Sequence[str],
    timeout: float = 120,
    isolation_level: str = "read_uncommitted",
) -> Row:
    """Wait for every id's answer, then count what reached Redis and the reply topic
    (as a reader with ``isolation_level`` sees it)."""
    await wait_for_results(redis_url, ids, timeout)
    client = aioredis.Redis.from_url(redis_url)
    try:
        stored = await client.mget([result_key(i) for i in ids])
    finally:
        await client.aclose()
    in_redis = {i: v for i, v in zip(ids, stored, strict=True) if v is not None}
    replies = await read_topic(
        bootstrap, topics_for(model).results, len(in_redis), 60, isolation_level
    )
    documents: dict[str, set[bytes]] = defaultdict(set)
    copies: dict[str, int] = defaultdict(int)
    for record in replies:
        key = record.key.decode()
        documents[key].add(record.value)
        copies[key] += 1
    answered = [i for i in ids if i in in_redis and i in documents]
    row = Row(
        scenario=scenario,
        produced=len(ids),
        answered=len(answered),
        lost=len(ids) - len(answered),
        duplicate_visible=sum(1 for i in answered if documents[i] != {in_redis[i]}),
        redelivered=sum(1 for i in answered if copies[i] > 1),
    )
    ROWS.append(row)
    return row


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    lines = [HEADER, "|" + "|".join("-" * (len(c)) for c in HEADER.split("|")[1:-1]) + "|"]
    lines += [row.line() for row in ROWS]
    terminalreporter.write_sep("=", "fault scenarios")
    for line in lines:
        terminalreporter.write_line(line)
    report = REPO / ".run" / "fault-report.txt"
    report.parent.mkdir(exist_ok=True)
    report.write_text("\n".join(lines) + "\n")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
            "KAFKA_PORT" if self.script == "kafka.sh" else "REDIS_PORT": str(self.port),
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
    service = LocalService("redis.sh", _free_port(), tmp_path / "run", {"REDIS_SAVE": "3600 1"})
    service.start()
    yield service
    service.stop()


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[LocalService]:
    # The controller listens on port + 1: pick a port whose neighbour is free too.
    while True:
        port = _free_port()
        try:
            socket.create_connection(("127.0.0.1", port + 1), timeout=0.2).close()
        except OSError:
            break
    service = LocalService("kafka.sh", port, tmp_path / "run")
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def digits() -> list[tuple[bytes, int]]:
    build_digits_model()
    return heldout_digits()


class Workers:
    """Worker processes of one test; all stopped at its end."""

    def __init__(self, model: str, bootstrap: str, redis_url: str, tmp: Path) -> None:
        self.model, self.bootstrap, self.redis_url, self.tmp = model, bootstrap, redis_url, tmp
        self.started: list[WorkerProcess] = []

    def start(
        self,
        *extra: str,
        spec: str = "digits",
        env: dict[str, str] | None = None,
        bootstrap: str | None = None,
        redis_url: str | None = None,
    ) -> WorkerProcess:
        worker = WorkerProcess(
            self.model,
            bootstrap or self.bootstrap,
            redis_url or self.redis_url,
            self.tmp / f"worker-{len(self.started)}.log",
            extra,
            spec,
            env or {},
        )
        self.started.append(worker.start())
        return worker

    def logs(self) -> str:
        return "\n".join(w.log() for w in self.started)


@pytest.fixture
def workers(
    kafka_bootstrap: str, redis_url: str, model_name: str, tmp_path: Path
) -> Iterator[Workers]:
    group = Workers(model_name, kafka_bootstrap, redis_url, tmp_path)
    yield group
    for worker in group.started:
        worker.stop()


async def until_answered(redis_url: str, ids: list[str], count: int, timeout: float = 120) -> None:
    """Wait until at least ``count`` of ``ids`` have results (the fault goes in then)."""
    deadline = time.monotonic() + timeout
    while (answered := await count_results(redis_url, ids)) < count:
        assert time.monotonic() < deadline, f"only {answered} of {count} answered in {timeout} s"
        await asyncio.sleep(0.05)


def check(row: Row, logs: str) -> None:
    assert row.lost == 0, logs[-5000:]
    assert row.duplicate_visible == 0


@asynccontextmanager
async def admin_for(bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def setup(
    bootstrap: str, model: str, digits: list[tuple[bytes, int]], n: int, partitions: int = 3
) -> tuple[list[OutgoingRecord], list[str]]:
    async with admin_for(bootstrap) as admin:
        await create_model_topics(admin, model, partitions)
    records = [r for r, _ in digit_requests(digits, n, prefix=model)]
    return records, [r.key.decode() for r in records]
