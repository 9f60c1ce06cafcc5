"""The wire contract as docs/contract.md writes it, checked against the real broker.

Records here are built by hand from the documentation, with a plain Kafka
client and with the kcat CLI, never through ``encode_request``: a producer in
another language has nothing but the documentation either.
"""

from __future__ import annotations

import asyncio
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import ContentType, ContractError, ErrorCode, decode_request, topics_for
from tests.conftest import CreateTopic

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))  # not a real image: the contract does not look


async def _records(bootstrap: str, topic: str, count: int) -> list[Any]:
    """The first ``count`` records of partition 0 of ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        records: list[Any] = []
        async with asyncio.timeout(30):
            while len(records) < count:
                batches = await consumer.getmany(timeout_ms=500)
                for batch in batches.values():
                    records.extend(batch)
        return records
    finally:
        await consumer.stop()


async def test_records_from_a_plain_kafka_client_decode(
    kafka_bootstrap: str, create_topic: CreateTopic, model_name: str
) -> None:
    topic = await create_topic(topics_for(model_name).requests, partitions=1)
    full = [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"full-1"),
        ("ce_type", b"conveyor.request.v1"),
        ("ce_source", b"interop-test"),
        ("content-type", b"image/png"),
        ("ce_time", b"2025-01-31T12:00:00Z"),
        ("ce_deadline", b"2025-01-31T12:00:05.250+01:00"),
        ("ce_replyto", b"my.replies"),
        ("ce_params", b'{"top_k": 3}'),
        ("ce_stream", b"cam-7"),
        ("ce_seq", b"12"),
        ("traceparent", TRACEPARENT.encode()),
        ("x-unknown", b"ignored"),
    ]
    not_utf8 = [(name, b"\xc3\x28" if name == "ce_source" else raw) for name, raw in full[:5]]
    no_id = [(name, raw) for name, raw in full[:5] if name != "ce_id"]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, PNG, key=b"cam-7", headers=full)
        await producer.send_and_wait(topic, PNG, key=b"full-1", headers=not_utf8)
        await producer.send_and_wait(topic, PNG, key=None, headers=no_id)
    finally:
        await producer.stop()

    first, second, third = await _records(kafka_bootstrap, topic, 3)
    request = decode_request(first.headers, first.key, first.value, first.timestamp)
    meta = request.meta
    assert request.payload == PNG
    assert (meta.id, meta.source, meta.content_type) == ("full-1", "interop-test", ContentType.PNG)
    assert meta.time == datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
    assert meta.deadline == datetime(2025, 1, 31, 11, 0, 5, 250000, tzinfo=UTC)
    assert (meta.reply_to, meta.params) == ("my.replies", {"top_k": 3})
    assert (meta.stream, meta.seq, meta.traceparent) == ("cam-7", 12, TRACEPARENT)
    assert meta.timestamp_ms == first.timestamp

    with pytest.raises(ContractError) as info:
        decode_request(second.headers, second.key, second.value, second.timestamp)
    assert (info.value.code, info.value.field, info.value.request_id) == (
        ErrorCode.bad_request,
        "ce_source",
        "full-1",  # an error result can still be written for it
    )
    with pytest.raises(ContractError) as info:
        decode_request(third.headers, third.key, third.value, third.timestamp)
    assert (info.value.field, info.value.request_id) == ("ce_id", None)  # dead-letter only


async def test_a_record_from_kcat_decodes(
    kafka_bootstrap: str, create_topic: CreateTopic, model_name: str, tmp_path: Path
) -> None:
    kcat = shutil.which("kcat")
    if kcat is None:
        pytest.fail(
            "kcat is not installed; `make install` installs it (Debian package kcat)",
            pytrace=False,
        )
    topic = await create_topic(topics_for(model_name).requests, partitions=1)
    image = tmp_path / "image.png"
    image.write_bytes(PNG)
    # The command docs/contract.md shows, header for header.
    process = await asyncio.create_subprocess_exec(
        kcat,
        "-P",
        "-b",
        kafka_bootstrap,
        "-t",
        topic,
        "-k",
        "id1",
        "-H",
        "ce_specversion=1.0",
        "-H",
        "ce_id=id1",
        "-H",
        "ce_type=conveyor.request.v1",
        "-H",
        "ce_source=kcat",
        "-H",
        "content-type=image/png",
        "-H",
        'ce_params={"top_k": 5}',
        str(image),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, (stdout + stderr).decode(errors="replace")

    (record,) = await _records(kafka_bootstrap, topic, 1)
    request = decode_request(record.headers, record.key, record.value, record.timestamp)
    assert request.payload == PNG
    assert record.key == b"id1"
    meta = request.meta
    assert (meta.id, meta.source, meta.content_type) == ("id1", "kcat", ContentType.PNG)
    assert meta.params == {"top_k": 5}
