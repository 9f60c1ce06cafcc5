"""Kafka from outside a worker: an admin client, requests, backlogs and paced load, reading a
topic back.

Topics are created and deleted with ``producers.admin`` (``create_model_topics``,
``delete_model_topics``): one way, the one ``conveyor topics create`` uses.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Literal, TypeAlias

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder

from schemas import ContentType, OutgoingRecord, encode_request

Isolation = Literal["read_uncommitted", "read_committed"]
Reply: TypeAlias = ConsumerRecord[bytes, bytes]
_MAX_REQUEST_BYTES = 64 << 20  # records as large as a test sends (the broker has the last word)
_PACED_BATCH_BYTES = 1 << 20


@asynccontextmanager
async def kafka_admin(bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    """aiokafka's admin client, started, for what ``producers.admin`` does not do."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


def requests(
    payloads: Sequence[bytes],
    count: int,
    prefix: str,
    content_type: ContentType,
    source: str = "tests",
    *,
    traced: bool = False,
) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` requests cycling through ``payloads``, ids ``<prefix>-<n>``; and their ids.
    ``traced``: each carries a sampled ``traceparent`` of a trace of its own."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    records = [
        encode_request(
            payloads[n % len(payloads)],
            request_id=i,
            content_type=content_type,
            source=source,
            traceparent=f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" if traced else None,
        )
        for n, i in enumerate(ids)
    ]
    return records, ids


async def produce(
    bootstrap: str,
    topic: str,
    records: Sequence[OutgoingRecord],
    *,
    round_robin: bool = False,
    transactional_id: str | None = None,
    before_commit: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Write ``records`` to ``topic`` as fast as the client can, acknowledged by every replica.

    Records go to partitions as any Kafka client's default partitioner puts them
    (by key), or with ``round_robin`` record ``i`` to partition ``i % P``, so the
    last ``P`` records are the last of each partition. They are appended to
    explicit batches, one per partition, sent when full: several times faster
    than one ``send`` each, so a backlog is in place before a worker starts and
    the producer does not compete with it for the CPU.

    With ``transactional_id`` they are written in one Kafka transaction, committed
    once all are written and ``before_commit`` (if given) has returned: workers,
    which read requests ``read_committed``, then see all of them at once.
    """
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        max_request_size=_MAX_REQUEST_BYTES,
        transactional_id=transactional_id,
    )
    await producer.start()
    try:
        if transactional_id is not None:
            await producer.begin_transaction()
        partitions = sorted(await producer.partitions_for(topic))
        by_key = DefaultPartitioner()
        batches = {p: producer.create_batch() for p in partitions}
        sent = []
        for n, record in enumerate(records):
            part = (
                partitions[n % len(partitions)]
                if round_robin
                else by_key(record.key, partitions, partitions)
            )
            if _append(batches[part], record) is None:  # full: send it, start the next one
                sent.append(await producer.send_batch(batches[part], topic, partition=part))
                batches[part] = producer.create_batch()
                _append(batches[part], record)  # a batch takes its first record, however large
        for part, batch in batches.items():
            if batch.record_count():
                sent.append(await producer.send_batch(batch, topic, partition=part))
        await asyncio.gather(*sent)
        if transactional_id is not None:
            if before_commit is not None:
                await before_commit()
            await producer.commit_transaction()
    finally:
        await producer.stop()


def _append(batch: BatchBuilder, record: OutgoingRecord) -> object:
    """The record's metadata, or None when the batch is full."""
    return batch.append(key=record.key, value=record.value, timestamp=None, headers=record.headers)


async def produce_at_rate(
    bootstrap: str,
    topic: str,
    records: Sequence[OutgoingRecord],
    rate: float,
    acked_ms: list[float] | None = None,
) -> float:
    """Send ``records`` open loop at ``rate`` per second; returns the rate achieved.

    Each record's timestamp is the time it was *due*, not when the client got
    round to it, so a producer that falls behind shows up as latency instead of
    hiding it (no coordinated omission); a topic with ``message.timestamp.type``
    ``LogAppendTime`` replaces it with the broker's append time. ``acked_ms``, when
    given, receives for each record the milliseconds from its due time to the broker's
    acknowledgement as this client saw it: the producer's and the broker's share of a
    request's latency.
    """
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=0,
        # aiokafka's 16 KB default puts every image in a batch of its own, and the client
        # has one request in flight to a broker: its rate would be at most one record per
        # partition per round trip, so a loaded broker would slow the pace itself.
        max_batch_size=_PACED_BATCH_BYTES,
        max_request_size=_MAX_REQUEST_BYTES,
    )
    await producer.start()
    try:
        sent = []
        start = time.time()
        for n, record in enumerate(records):
            due = start + n / rate
            await asyncio.sleep(max(0.0, due - time.time()))  # the pace: not a readiness wait
            ack = await producer.send(
                topic,
                record.value,
                key=record.key,
                headers=record.headers,
                timestamp_ms=int(due * 1000),
            )
            if acked_ms is not None:
                ack.add_done_callback(partial(_acked, acked_ms, int(due * 1000)))
            sent.append(ack)
        await asyncio.gather(*sent)
        elapsed = time.time() - start
    finally:
        await producer.stop()
    return len(records) / elapsed if elapsed > 0 else float("nan")


def _acked(acked_ms: list[float], due_ms: int, _: object) -> None:
    acked_ms.append(time.time() * 1000 - due_ms)  # from the record's timestamp, as the worker


async def read_topic(
    bootstrap: str,
    topic: str,
    expect: int,
    timeout_s: float,
    isolation_level: Isolation = "read_uncommitted",
) -> list[Reply]:
    """Every record of ``topic`` from the beginning: at least ``expect`` of them (or as
    many as came before ``timeout_s``), then on to the end offsets as they stand then,
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
    records: list[Reply] = []
    deadline = time.monotonic() + timeout_s
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
