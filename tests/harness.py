"""What the integration, fault and cluster tests add to ``producers.testing``.

``producers.testing`` drives workers and reads results for tests and benchmarks
alike; here are the tests' own pieces: the flags every test worker gets, digit
requests, the fault table (``record`` adds a scenario's ``Tally`` to the table
printed at the end of the run and written to .run/fault-report.txt) and its
checks, a worker's metrics, the exactly-once helpers, and ``LocalService``: a Kafka
broker, Redis server or S3 gateway of a test's own (one it may stop, or one whose whole
data it may throw away while other tests run beside it).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from producers.admin import Role, create_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import (
    Isolation,
    Tally,
    WorkerProcess,
    http_get,
    read_topic,
    requests,
    tally,
)
from schemas import ContentType, OutgoingRecord, encode_request, topics_for

T = TypeVar("T")
_LOCAL_SCRIPTS = Path(__file__).resolve().parents[1] / "compose" / "local"
TEST_WORKER_OPTIONS = ("--decode-threads", "2", "--session-timeout-ms", "6000")
"""Every test worker's: two decode threads (the machine may have no more cores), and a
group session short enough that a killed worker's partitions move on within seconds."""


def digit_requests(
    images: Sequence[tuple[bytes, int]], count: int, prefix: str
) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` requests cycling through ``images`` (PNG, digit), ids ``<prefix>-<n>``."""
    return requests([png for png, _digit in images], count, prefix, ContentType.PNG)


async def setup_model(
    bootstrap: str,
    model: str,
    images: Sequence[tuple[bytes, int]],
    n: int,
    partitions: int = 3,
    replication_factor: int = 1,
    leaders: Mapping[Role, int] | None = None,
) -> tuple[list[OutgoingRecord], list[str]]:
    """Create the model's topics; return ``n`` digit requests and their ids."""
    settings = ClientSettings(kafka_bootstrap=bootstrap)
    await create_model_topics(settings, model, partitions, replication_factor, leaders=leaders)
    return digit_requests(images, n, prefix=model)


def rss_mb(pid: int) -> float:
    """The process's resident memory now, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def peak_rss_mb_while(worker: WorkerProcess, work: Awaitable[T]) -> tuple[float, T]:
    """The worker's highest resident memory (MiB, sampled every 20 ms) while ``work`` runs,
    and what ``work`` returned."""
    peak = rss_mb(worker.pid)
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, rss_mb(worker.pid))
        await asyncio.sleep(0.02)  # the sampling interval, not a wait for readiness
    return peak, await task


def s3_flags(options: Mapping[str, str], bucket: str) -> list[str]:
    """Worker flags for reading payloads from ``bucket`` of the S3 store of ``options``
    (``S3Settings`` fields)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    return ["--dataref-s3-buckets", bucket, *flags]


def logged_at(line: str) -> float:
    """The time (epoch seconds) of a worker's log line: its default format begins with it."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def metrics(worker: WorkerProcess) -> dict[str, float]:
    """The worker's /metrics now: each sample name's value, summed over its labels."""
    port = worker.metrics_port()
    assert port is not None, worker.log()
    _, body = await http_get(port, "/metrics")
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def requests_by_status(exposition: str, model: str) -> dict[str, float]:
    """``conveyor_requests_total`` of ``model`` in a /metrics text, by status (summed over
    its other labels: version, role, process)."""
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "conveyor_requests_total" and sample.labels.get("model") == model:
                totals[sample.labels["status"]] += sample.value
    return dict(totals)


# -- the fault table ---------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    scenario: str
    tally: Tally

    def line(self) -> str:
        t = self.tally
        return (
            f"| {self.scenario:<50} | {t.produced:>8} | {t.answered:>8} | "
            f"{t.lost:>4} | {t.duplicate_visible:>17} | {t.redelivered:>11} |"
        )


ROWS: list[Row] = []
"""Scenarios tallied in this process since the last ``take_records``, in order."""
NOTES: list[str] = []
"""Measurements a scenario reports beside its row (printed under the table)."""
HEADER = (
    f"| {'scenario':<50} | {'produced':>8} | {'answered':>8} | {'lost':>4} | "
    f"{'duplicate-visible':>17} | {'redelivered':>11} |"
)


def take_records() -> tuple[list[str], list[str]]:
    """The table lines of ``ROWS`` and the ``NOTES`` recorded since the last call, which
    this clears: tests/conftest.py hands each test's to its report, so the process that
    prints the table (the one of ``pytest -n``'s controller) has every worker's."""
    lines, notes = [row.line() for row in ROWS], list(NOTES)
    ROWS.clear()
    NOTES.clear()
    return lines, notes


def fault_table(lines: Sequence[str]) -> list[str]:
    """The Markdown table of rows' ``lines`` (``Row.line``)."""
    rule = "|" + "|".join("-" * len(cell) for cell in HEADER.split("|")[1:-1]) + "|"
    return [HEADER, rule, *lines]


async def tally_scenario(
    scenario: str,
    bootstrap: str,
    redis_url: str,
    model: str,
    ids: Sequence[str],
    timeout_s: float = 120,
    isolation_level: Isolation = "read_uncommitted",
) -> Tally:
    """``producers.testing.tally`` of the model's requests ``ids``, added to the fault table
    as ``scenario``'s row. (Its parameters mirror ``tally``'s, with the model in place of its
    reply topic: a wrapper, not a copy.)"""
    counted = await tally(
        bootstrap, redis_url, topics_for(model).results, ids, timeout_s, isolation_level
    )
    ROWS.append(Row(scenario, counted))
    return counted


def check(tally: Tally, logs: str) -> None:
    """The guarantee of docs/reliability.md: nothing lost, one visible answer per id."""
    assert tally.lost == 0, logs[-5000:]
    assert tally.duplicate_visible == 0, logs[-5000:]


def check_exactly_once(tally: Tally, logs: str) -> None:
    """``check``, and no id twice for a read_committed reader of the reply topic."""
    check(tally, logs)
    assert tally.redelivered == 0, logs[-5000:]


def endless_digit_requests(
    images: Sequence[tuple[bytes, int]], prefix: str
) -> Iterator[OutgoingRecord]:
    """Digit requests without end, as ``digit_requests`` makes them (ids ``<prefix>-<n>``
    from 0, cycling through ``images``): a stream for ``submit_paced`` that lasts as
    long as the faults it carries through take, until its ``stop`` is set."""
    for n in itertools.count():
        png, _digit = images[n % len(images)]
        yield encode_request(
            png, request_id=f"{prefix}-{n}", content_type=ContentType.PNG, source="tests"
        )


async def submit_paced(
    bootstrap: str,
    model: str,
    records: Iterable[OutgoingRecord],
    chunk: int = 100,
    pause_s: float = 0.2,
    stop: asyncio.Event | None = None,
) -> list[str]:
    """Send ``records`` with the SDK, ``chunk`` at a time with a pause between: a steady
    stream that a fault can land in the middle of. Stops early once ``stop`` is set
    (``endless_digit_requests`` end only then). Returns the ids sent (the records' own)."""
    sent: list[str] = []
    settings = ClientSettings(kafka_bootstrap=bootstrap)
    source = iter(records)
    async with AsyncClient(settings) as client:
        while not (stop is not None and stop.is_set()):
            part = list(itertools.islice(source, chunk))
            if not part:
                break
            sent += await client.submit_many(
                [r.value for r in part],
                model=model,
                request_ids=[r.key.decode() for r in part],
                content_type=ContentType.PNG,
            )
            await asyncio.sleep(pause_s)  # the pace of the stream, not a wait for readiness
    return sent


# -- exactly-once delivery -----------------------------------------------------------------


async def extra_records_uncommitted(bootstrap: str, model: str, ids: list[str]) -> int:
    """Reply records beyond one per id, as a read_uncommitted reader sees them."""
    records = await read_topic(bootstrap, topics_for(model).results, len(ids), 60)
    counts = Counter(record.key.decode() for record in records)
    return sum(count - 1 for count in counts.values())


async def kill_inside_a_transaction(
    worker: WorkerProcess, bootstrap: str, topic: str, partitions: int = 3
) -> bool:
    """SIGKILL ``worker`` while it has a transaction open on ``topic`` (records there past
    the last stable offset), if it opens one within 30 s: the worker is stopped
    (SIGSTOP) whenever one looks open, checked again while it cannot finish it, then
    killed or let go on. Returns whether the kill left a transaction open."""
    readers = [
        AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=level)
        for level in ("read_committed", "read_uncommitted")
    ]
    for reader in readers:
        await reader.start()
    tps = [TopicPartition(topic, p) for p in range(partitions)]

    async def open_transaction() -> bool:
        stable, ends = [await reader.end_offsets(tps) for reader in readers]
        return any(ends[tp] > stable[tp] for tp in tps)

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if await open_transaction():
                worker.pause()
                await asyncio.sleep(0.2)  # let a commit already sent complete
                if await open_transaction():
                    break
                worker.resume()
            await asyncio.sleep(0.002)  # polling the broker, not waiting for readiness
        worker.signal(signal.SIGKILL)
        worker.wait()
        return await open_transaction()
    finally:
        for reader in readers:
            await reader.stop()


# -- services of a test's own ----------------------------------------------------------------

_PORT_VARIABLE = {"kafka.sh": "KAFKA_PORT", "redis.sh": "REDIS_PORT", "seaweedfs.sh": "S3_PORT"}


@dataclass
class LocalService:
    """A Kafka broker, Redis server or S3 gateway of a test's own, started by compose/local
    scripts."""

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
            [str(_LOCAL_SCRIPTS / self.script), action],
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
