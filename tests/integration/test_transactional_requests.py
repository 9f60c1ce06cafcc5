"""Requests written in Kafka transactions: served once committed, never when aborted."""

from __future__ import annotations

import uuid

from aiokafka import AIOKafkaProducer

from producers.testing import read_results, requests, wait_for_results
from schemas import ContentType, OutgoingRecord, Status, topics_for

PARTITIONS = 3  # served_model's


async def _in_a_transaction(
    bootstrap: str, topic: str, records: list[OutgoingRecord], *, commit: bool
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, transactional_id=f"test-{uuid.uuid4().hex[:8]}"
    )
    await producer.start()
    try:
        await producer.begin_transaction()
        for n, record in enumerate(records):  # every partition gets some
            await producer.send_and_wait(
                topic,
                record.value,
                key=record.key,
                headers=record.headers,
                partition=n % PARTITIONS,
            )
        if commit:
            await producer.commit_transaction()
        else:
            await producer.abort_transaction()
    finally:
        await producer.stop()


async def test_aborted_requests_are_never_served_and_committed_ones_are(
    kafka_bootstrap: str, redis_url: str, served_model: str, digits: list[tuple[bytes, int]]
) -> None:
    topic = topics_for(served_model).requests
    pngs = [png for png, _ in digits[:12]]
    aborted, aborted_ids = requests(pngs, 12, f"abort-{uuid.uuid4().hex[:6]}", ContentType.PNG)
    committed, committed_ids = requests(pngs, 12, f"commit-{uuid.uuid4().hex[:6]}", ContentType.PNG)

    await _in_a_transaction(kafka_bootstrap, topic, aborted, commit=False)
    await _in_a_transaction(kafka_bootstrap, topic, committed, commit=True)

    results = await wait_for_results(redis_url, committed_ids, 60)
    assert sorted(results) == sorted(committed_ids)
    assert all(result.status is Status.ok for result in results.values())
    # Every partition's aborted requests come before its committed ones, and those are
    # all answered: the worker has passed the aborted ones without serving them.
    assert await read_results(redis_url, aborted_ids) == {}
