"""The real Kafka broker and Redis server are up and behave as the worker needs."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tests.conftest import CreateTopic


async def test_kafka_round_trip_with_headers_over_partitions(
    kafka_bootstrap: str, create_topic: CreateTopic, uid: str
) -> None:
    topic = await create_topic(f"test.{uid}.records", partitions=3)
    sent = {f"key-{i}": f"value-{i}".encode() for i in range(30)}

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in sent.items():
            await producer.send(
                topic, value, key=key.encode(), headers=[("ce_id", key.encode()), ("n", b"1")]
            )
        await producer.flush()
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"test.{uid}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    received: dict[str, bytes] = {}
    partitions_seen: set[int] = set()
    try:
        async with asyncio.timeout(30):
            while len(received) < len(sent):
                batches = await consumer.getmany(timeout_ms=500)
                for tp, records in batches.items():
                    partitions_seen.add(tp.partition)
                    for record in records:
                        headers = dict(record.headers)
                        assert record.key is not None
                        assert headers["ce_id"] == record.key
                        received[record.key.decode()] = record.value
        await consumer.commit()
        committed = [await consumer.committed(TopicPartition(topic, p)) for p in range(3)]
    finally:
        await consumer.stop()

    assert received == sent
    assert partitions_seen == {0, 1, 2}  # 30 distinct keys land on all 3 partitions
    assert sum(c or 0 for c in committed) == len(sent)


async def test_redis_key_with_ttl(redis_client: aioredis.Redis, redis_prefix: str) -> None:
    key = f"{redis_prefix}result"
    assert await redis_client.set(key, b"first", nx=True, ex=60)
    assert not await redis_client.set(key, b"second", nx=True, ex=60)  # first write wins
    assert await redis_client.get(key) == b"first"
    ttl = await redis_client.ttl(key)
    assert 0 < ttl <= 60
