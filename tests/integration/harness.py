"""Drive real worker processes against the real broker and Redis, for integration tests.

A test creates its model's topics, produces requests, runs ``conveyor worker`` as a
child process (so SIGKILL and SIGTERM are real), and collects what reached Redis
and the reply topic: ``tally`` counts a fault scenario's produced, answered, lost,
duplicate-visible and redelivered requests into the table printed at the end.

A Redis Cluster is named by a ``redis+cluster://host:port/0`` URL here (any
node): the helpers read it with redis-py's own cluster client, an implementation
independent of Conveyor's, and ``WorkerProcess`` passes ``--redis-cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from redis.asyncio.cluster import RedisCluster

from producers.client import AsyncClient
from producers.settings import ClientSettings
from schemas import (
    ContentType,
    OutgoingRecord,
    Result,
    decode_result,
    encode_request,
    result_key,
    topics_for,
)

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCHEME = "redis+cluster"


def is_cluster(redis_url: str) -> bool:
    return redis_url.startswith(f"{CLUSTER_SCHEME}://")


def plain_url(redis_url: str) -> str:
    """The URL a worker or the SDK is given (``redis://``, with ``redis_cluster`` on)."""
    return redis_url.replace(f"{CLUSTER_SCHEME}://", "redis://", 1)


@asynccontextmanager
async def redis_reader(redis_url: str) -> AsyncIterator[aioredis.Redis | RedisCluster]:
    """A redis-py client for ``redis_url``: a cluster client for a ``redis+cluster`` URL."""
    client: aioredis.Redis | RedisCluster = (
        RedisCluster.from_url(plain_url(redis_url))
        if is_cluster(redis_url)
        else aioredis.Redis.from_url(redis_url)
    )
    try:
        yield client
    finally:
        await client.aclose()


async def _values(client: aioredis.Redis | RedisCluster, keys: Sequence[str]) -> list[Any]:
    if isinstance(client, RedisCluster):
        return list(await client.mget_nonatomic(keys))
    return list(await client.mget(keys))


async def create_model_topics(
    admin: AIOKafkaAdminClient,
    model: str,
    partitions: int = 3,
    replication_factor: int = 1,
    leaders: Mapping[str, int] | None = None,
) -> None:
    """The model's request, result and dead-letter topics.

    ``leaders`` maps "requests" or "results" to a broker id that leads every partition
    of that topic (its first replica; the others follow in id order), so a test
    knows which broker to kill.
    """
    topics = topics_for(model)

    def topic(name: str, role: str, count: int) -> NewTopic:
        leader = (leaders or {}).get(role)
        if leader is None:
            return NewTopic(name, count, replication_factor)
        others = [b for b in range(1, replication_factor + 1) if b != leader]
        replicas = [leader, *others][:replication_factor]
        return NewTopic(name, -1, -1, replica_assignments=dict.fromkeys(range(count), replicas))

    await admin.create_topics(
        [
            topic(topics.requests, "requests", partitions),
            topic(topics.results, "results", partitions),
            topic(topics.dlq, "dlq", 1),
        ]
    )


@asynccontextmanager
async def admin_for(bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def setup_model(
    bootstrap: str,
    model: str,
    images: Sequence[tuple[bytes, int]],
    n: int,
    partitions: int = 3,
    replication_factor: int = 1,
    leaders: Mapping[str, int] | None = None,
) -> tuple[list[OutgoingRecord], list[str]]:
    """Create the model's topics; return ``n`` digit requests and their ids."""
    async with admin_for(bootstrap) as admin:
        await create_model_topics(admin, model, partitions, replication_factor, leaders)
    records = [r for r, _ in digit_requests(images, n, prefix=model)]
    return records, [r.key.decode() for r in records]


def digit_requests(
    images: Sequence[tuple[bytes, int]], count: int, prefix: str
) -> list[tuple[OutgoingRecord, int]]:
    """``count`` requests cycling through ``images``; returns (record, true digit) pairs."""
    out = []
    for n in range(count):
        png, digit = images[n % len(images)]
        record = encode_request(
            png, request_id=f"{prefix}-{n}", content_type=ContentType.PNG, source="tests"
        )
        out.append((record, digit))
    return out


async def produce(bootstrap: str, topic: str, records: Iterable[OutgoingRecord]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, r.value, key=r.key, headers=r.headers) for r in records
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def redis_results(redis_url: str, ids: Sequence[str]) -> dict[str, Result]:
    """The results present in Redis now, by request id."""
    async with redis_reader(redis_url) as client:
        found: dict[str, Result] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            values = await _values(client, [result_key(i) for i in chunk])
            found.update(
                {
                    i: decode_result(v)
                    for i, v in zip(chunk, values, strict=True)
                    if isinstance(v, bytes)
                }
            )
        return found


async def count_results(redis_url: str, ids: Sequence[str]) -> int:
    """How many of ``ids`` have a result in Redis now (cheap: no decoding)."""
    async with redis_reader(redis_url) as client:
        if isinstance(client, RedisCluster):
            return await client.exists(*(result_key(i) for i in ids))
        pipe = client.pipeline(transaction=False)
        for i in ids:
            pipe.exists(result_key(i))
        return sum(await pipe.execute())


async def wait_for_results(
    redis_url: str, ids: Sequence[str], timeout: float, poll: float = 0.2
) -> dict[str, Result]:
    """Poll Redis until every id has a result or the timeout passes.

    Returns what is there either way, so a test can show exactly what is missing.
    (A monotonic deadline, not ``asyncio.timeout``: the Redis client may swallow
    the cancellation that ``asyncio.timeout`` relies on.)
    """
    found: dict[str, Result] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(ids) and time.monotonic() < deadline:
        missing = [i for i in ids if i not in found]
        found.update(await redis_results(redis_url, missing))
        if len(found) < len(ids):
            await asyncio.sleep(poll)  # polling interval, not a wait for readiness
    return found


async def until_answered(redis_url: str, ids: list[str], count: int, timeout: float = 120) -> None:
    """Wait until at least ``count`` of ``ids`` have results (a fault goes in then)."""
    deadline = time.monotonic() + timeout
    while (answered := await count_results(redis_url, ids)) < count:
        assert time.monotonic() < deadline, f"only {answered} of {count} answered in {timeout} s"
        await asyncio.sleep(0.05)


async def read_topic(
    bootstrap: str,
    topic: str,
    expect: int,
    timeout: float,
    isolation_level: str = "read_uncommitted",
) -> list[Any]:
    """Every record of ``topic`` from the beginning: at least ``expect`` of them (or as
    many as came before ``timeout``), then on to the end offsets as they stand then,
    so a duplicate never hides a record that is there. ``read_committed`` skips records
    of aborted transactions and reads only up to the last stable offset."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation_level,
    )
    await consumer.start()
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    try:

        async def read_more() -> None:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(recs)

        while len(records) < expect and time.monotonic() < deadline:
            await read_more()
        tps = list(consumer.assignment())  # every partition: no group, so all are ours
        ends = await consumer.end_offsets(tps)

        async def behind() -> bool:
            for tp in tps:
                if await consumer.position(tp) < ends[tp]:
                    return True
            return False

        while time.monotonic() < deadline and await behind():
            await read_more()
    finally:
        await consumer.stop()
    return records


@dataclass
class WorkerProcess:
    """``conveyor worker`` as a child process, its log in a file."""

    model: str
    bootstrap: str
    redis_url: str
    log_path: Path
    extra: Sequence[str] = ()
    spec: str = "digits"
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        argv = [
            sys.executable,
            "-m",
            "producers.cli",
            "worker",
            "--model",
            self.spec,
            "--model-name",
            self.model,
            "--kafka-bootstrap",
            self.bootstrap,
            "--redis-url",
            plain_url(self.redis_url),
            *(["--redis-cluster"] if is_cluster(self.redis_url) else []),
            "--device",
            "cpu",
            "--decode-threads",
            "2",
            "--session-timeout-ms",
            "6000",
            "--metrics-port",
            "0",  # several workers share this host
            *self.extra,
        ]
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        return self

    def signal(self, signum: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_port(self) -> int | None:
        """The port of its /metrics, /healthz and /readyz, once its log says it."""
        found = re.search(r"metrics and health on http://[^:]+:(\d+)", self.log())
        return int(found.group(1)) if found else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


_ASSIGNED = re.compile(r"partitions assigned: (.*)$", re.MULTILINE)


def free_port() -> int:
    """A free port from 10000-19999, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is in the ephemeral range, where any
    client connection opened before the server binds may take it as its local
    port; Kafka then exits at start-up. Ports derived from this one by adding up to
    11000 (SeaweedFS's, a cluster's) stay below 32768 too.
    """
    for _ in range(1000):
        port = random.randrange(10000, 20000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 10000-19999 on 127.0.0.1")


def assigned_partitions(log: str) -> set[int] | None:
    """The partitions of a worker's latest assignment, from its log; None before its first."""
    lines = _ASSIGNED.findall(log)
    return {int(p) for p in re.findall(r"\[(\d+)\]", lines[-1])} if lines else None


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """(status, body) of one GET; raises OSError while nothing listens on the port."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # the server closes after answering
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout: float,
    logs: Callable[[], str],
) -> None:
    """Poll ``condition()`` (sync or async) until true; fail naming ``what`` with the logs."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        assert time.monotonic() < deadline, f"{what} within {timeout} s\n{logs()[-5000:]}"
        await asyncio.sleep(0.1)  # polling interval, not a wait for readiness


class Workers:
    """Worker processes of one test; ``stop_all`` at its end."""

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

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()


# -- the fault table ---------------------------------------------------------------------


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
            f"| {self.scenario:<50} | {self.produced:>8} | {self.answered:>8} | "
            f"{self.lost:>4} | {self.duplicate_visible:>17} | {self.redelivered:>11} |"
        )


ROWS: list[Row] = []
"""Every scenario tallied in this test run, in order (printed by tests/conftest.py)."""
NOTES: list[str] = []
"""Measurements a scenario reports beside its row (printed under the table)."""
HEADER = (
    f"| {'scenario':<50} | {'produced':>8} | {'answered':>8} | {'lost':>4} | "
    f"{'duplicate-visible':>17} | {'redelivered':>11} |"
)


def fault_table() -> list[str]:
    """The Markdown table of ``ROWS``."""
    rule = "|" + "|".join("-" * len(cell) for cell in HEADER.split("|")[1:-1]) + "|"
    return [HEADER, rule, *(row.line() for row in ROWS)]


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
    async with redis_reader(redis_url) as client:
        stored = await _values(client, [result_key(i) for i in ids])
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


def check(row: Row, logs: str) -> None:
    """The guarantee of docs/reliability.md: nothing lost, one visible answer per id."""
    assert row.lost == 0, logs[-5000:]
    assert row.duplicate_visible == 0, logs[-5000:]


async def submit_paced(
    bootstrap: str,
    model: str,
    records: Sequence[OutgoingRecord],
    chunk: int = 100,
    pause_s: float = 0.2,
    stop: asyncio.Event | None = None,
) -> list[str]:
    """Send ``records`` with the SDK, ``chunk`` at a time with a pause between: a steady
    stream that a fault can land in the middle of. Stops early once ``stop`` is set.
    Returns the ids sent (the records' own)."""
    sent: list[str] = []
    settings = ClientSettings(kafka_bootstrap=bootstrap)
    async with AsyncClient(settings) as client:
        for begin in range(0, len(records), chunk):
            if stop is not None and stop.is_set():
                break
            part = records[begin : begin + chunk]
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
                worker.signal(signal.SIGSTOP)
                await asyncio.sleep(0.2)  # let a commit already sent complete
                if await open_transaction():
                    break
                worker.signal(signal.SIGCONT)
            await asyncio.sleep(0.002)  # polling the broker, not waiting for readiness
        worker.signal(signal.SIGKILL)
        worker.wait()
        return await open_transaction()
    finally:
        for reader in readers:
            await reader.stop()


def check_exactly_once(row: Row, logs: str) -> None:
    assert row.lost == 0, logs[-5000:]
    assert row.duplicate_visible == 0, logs[-5000:]
    assert row.redelivered == 0, logs[-5000:]  # no id twice for a read_committed reader
