"""Benchmark plumbing against the real broker and Redis: topics, producers, result readers.

Nothing here times anything; ``bench.cpu`` decides what a measurement spans.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import SecretStr

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from schemas import ModelTopics, OutgoingRecord, Result, decode_result, result_key, topics_for

_MGET_CHUNK = 1000
_POLL_S = 0.01  # how often the last result of each partition is looked for
_LEADER_WAIT_S = 30.0


@dataclass(frozen=True)
class Services:
    """Where the broker and Redis are."""

    kafka_bootstrap: str
    redis_url: str

    def client_settings(self) -> ClientSettings:
        return ClientSettings(
            kafka_bootstrap=self.kafka_bootstrap, redis_url=SecretStr(self.redis_url)
        )


async def create_topics(services: Services, model: str, partitions: int) -> ModelTopics:
    """A fresh model's request, result and DLQ topics, once every partition has a leader.

    Producing to a topic created a moment ago otherwise meets "not leader" errors
    that the client retries after a back-off, which would land inside a measurement.
    """
    await create_model_topics(services.client_settings(), model, partitions)
    topics = topics_for(model)
    names = [topics.requests, topics.results, topics.dlq]
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(_LEADER_WAIT_S):
            for _attempt in itertools.count():
                if _all_led(await admin.describe_topics(names)):
                    break
                await asyncio.sleep(_POLL_S)
    finally:
        await admin.close()
    return topics


def _all_led(described: Sequence[dict[str, Any]]) -> bool:
    return all(
        topic["error_code"] == 0
        and topic["partitions"]
        and all(p["error_code"] == 0 and p["leader"] >= 0 for p in topic["partitions"])
        for topic in described
    )


async def delete_topics(services: Services, topics: ModelTopics) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topics.requests, topics.results, topics.dlq])
    finally:
        await admin.close()


async def produce_backlog(
    services: Services, topic: str, records: Sequence[OutgoingRecord], partitions: int
) -> None:
    """Write ``records`` as fast as the client can; record ``i`` goes to partition ``i % P``.

    Records are appended to explicit batches (one per partition, sent when full),
    which is several times faster than one ``send`` per record; the backlog is
    then in place before a worker starts, so the producer never competes with it
    for the CPU.
    """
    producer = AIOKafkaProducer(
        bootstrap_servers=services.kafka_bootstrap, acks="all", max_request_size=4 << 20
    )
    await producer.start()
    try:
        pending = []
        batches = [producer.create_batch() for _ in range(partitions)]
        for n, record in enumerate(records):
            part = n % partitions
            added = batches[part].append(
                key=record.key, value=record.value, timestamp=None, headers=record.headers
            )
            if added is None:  # full: send it and start the next one
                pending.append(await producer.send_batch(batches[part], topic, partition=part))
                batches[part] = producer.create_batch()
                batches[part].append(
                    key=record.key, value=record.value, timestamp=None, headers=record.headers
                )
        for part, batch in enumerate(batches):
            if batch.record_count():
                pending.append(await producer.send_batch(batch, topic, partition=part))
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def produce_at_rate(
    services: Services, topic: str, records: Sequence[OutgoingRecord], rate: float
) -> float:
    """Send ``records`` open loop at ``rate`` per second; returns the rate achieved.

    Each record's timestamp is the time it was *due*, not when the client got
    round to it, so a producer that falls behind shows up as latency instead of
    hiding it (no coordinated omission).
    """
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        pending = []
        start = time.time()
        for n, record in enumerate(records):
            due = start + n / rate
            wait = due - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            pending.append(
                await producer.send(
                    topic,
                    record.value,
                    key=record.key,
                    headers=record.headers,
                    timestamp_ms=int(due * 1000),
                )
            )
        await asyncio.gather(*pending)
        elapsed = time.time() - start
    finally:
        await producer.stop()
    return len(records) / elapsed if elapsed > 0 else float("nan")


async def wait_for_results(
    services: Services, ids: Sequence[str], last_ids: Sequence[str], timeout_s: float
) -> float:
    """Wait until every id has a result in Redis; returns the wall time (epoch s) it was seen.

    Only ``last_ids`` (the last request of each partition) are polled, every
    10 ms, so the poller stays cheap; a worker answers a partition in order, so
    once those are in, the rest should be too, which one full check confirms.
    """
    client = aioredis.Redis.from_url(services.redis_url)
    try:
        async with asyncio.timeout(timeout_s):
            missing = list(last_ids)
            while missing:
                missing = await _missing(client, missing)
                if missing:
                    await asyncio.sleep(_POLL_S)
            seen_at = time.time()
            missing = await _missing(client, ids)
            while missing:
                await asyncio.sleep(_POLL_S)
                missing = await _missing(client, missing)
                seen_at = time.time()
            return seen_at
    finally:
        await client.aclose()


async def read_results(services: Services, ids: Sequence[str]) -> list[Result]:
    """The results of ``ids`` that are in Redis now."""
    client = aioredis.Redis.from_url(services.redis_url)
    try:
        results: list[Result] = []
        for start in range(0, len(ids), _MGET_CHUNK):
            chunk = [result_key(i) for i in ids[start : start + _MGET_CHUNK]]
            values = await client.mget(chunk)
            results.extend(decode_result(v) for v in values if isinstance(v, bytes))
        return results
    finally:
        await client.aclose()


async def delete_results(services: Services, ids: Sequence[str]) -> None:
    client = aioredis.Redis.from_url(services.redis_url)
    try:
        for start in range(0, len(ids), _MGET_CHUNK):
            await client.delete(*(result_key(i) for i in ids[start : start + _MGET_CHUNK]))
    finally:
        await client.aclose()


async def _missing(client: aioredis.Redis, ids: Sequence[str]) -> list[str]:
    missing: list[str] = []
    for start in range(0, len(ids), _MGET_CHUNK):
        chunk = ids[start : start + _MGET_CHUNK]
        values = await client.mget([result_key(i) for i in chunk])
        missing.extend(i for i, v in zip(chunk, values, strict=True) if v is None)
    return missing
