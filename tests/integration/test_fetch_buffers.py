"""The worker's consumer reads real fetch responses through ``FrameReader``, byte for byte."""

from __future__ import annotations

import asyncio
import random

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import produce, requests
from schemas import ContentType, consumer_group, topics_for
from workers.config.worker import WorkerSettings
from workers.kafka.consumer import Consumer
from workers.kafka.fetch_buffers import MAX_FETCH_BYTES, FrameReader


async def test_large_and_small_records_arrive_intact_through_frame_readers(
    kafka_bootstrap: str, client_settings: ClientSettings, model_name: str, drop_topics: list[str]
) -> None:
    await create_model_topics(client_settings, model_name, partitions=3)
    drop_topics.append(model_name)
    rng = random.Random(7)
    # Sizes around the transport's 256 KiB reads, tiny ones, and one that fills a whole
    # fetch response (the largest payload the contract allows).
    sizes = [rng.choice([1, 300, 70_000, 262_143, 262_145, 900_000]) for _ in range(60)]
    sizes.append(MAX_FETCH_BYTES)
    payloads = [rng.randbytes(size) for size in sizes]
    records, ids = requests(payloads, len(payloads), "fb", ContentType.TEXT)
    topic = topics_for(model_name).requests
    await produce(kafka_bootstrap, topic, records, round_robin=True)

    settings = WorkerSettings(
        model="bench.identity:Identity", model_name=model_name, kafka_bootstrap=kafka_bootstrap
    )
    got: dict[str, bytes] = {}
    async with Consumer(settings, topic, consumer_group(model_name)) as consumer:
        async with asyncio.timeout(60):
            while len(got) < len(ids):
                for batch in (await consumer.fetch(500, 64)).values():
                    for record in batch:
                        request_id = dict(record.headers)["ce_id"] or b""
                        got[request_id.decode()] = record.value or b""
        readers = [conn._reader for conn in consumer._kafka._client._conns.values()]
    assert readers
    assert all(isinstance(reader, FrameReader) for reader in readers)
    assert got == dict(zip(ids, payloads, strict=True))
