"""Drive real worker processes against the real broker and Redis, for integration tests.

A test creates its model's topics, produces requests, runs ``conveyor worker`` as a
child process (so SIGKILL and SIGTERM are real), and collects what reached Redis
and the reply topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

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


async def create_model_topics(admin: AIOKafkaAdminClient, model: str, partitions: int = 3) -> None:
    topics = topics_for(model)
    await admin.create_topics(
        [
            NewTopic(topics.requests, partitions, 1),
            NewTopic(topics.results, partitions, 1),
            NewTopic(topics.dlq, 1, 1),
        ]
    )


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
    client = aioredis.Redis.from_url(redis_url)
    try:
        found: dict[str, Result] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            values = await client.mget([result_key(i) for i in chunk])
            found.update(
                {
                    i: decode_result(v)
                    for i, v in zip(chunk, values, strict=True)
                    if isinstance(v, bytes)
                }
            )
        return found
    finally:
        await client.aclose()


async def count_results(redis_url: str, ids: Sequence[str]) -> int:
    """How many of ``ids`` have a result in Redis now (cheap: no decoding)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        for i in ids:
            pipe.exists(result_key(i))
        return sum(await pipe.execute())
    finally:
        await client.aclose()


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
            self.redis_url,
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
