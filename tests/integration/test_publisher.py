"""The publisher on the real broker and Redis: publishes that overlap keep each request
partition's results in the order the calls began on its reply partition; dead letters
reach the DLQ and stay in their outbox to be counted; a Redis that closes its first
connection is a clear failure to connect."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer

from common.security import ConnectFailed
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from schemas import ModelTopics, Status, topics_for
from schemas.fastpath import ResultEncoder
from schemas.naming import result_key
from workers.config.worker import WorkerSettings
from workers.kafka.topics import TopicFacts, check_topics
from workers.publish.cluster_store import open_result_store
from workers.publish.publisher import Publisher
from workers.publish.result_store import ResultStore
from workers.types import DeadLetter, Outbox

pytestmark = pytest.mark.integration


class FirstWriteSlow:
    """The real result store, its first write held back ``delay_s`` (a slow Redis call)."""

    def __init__(self, store: ResultStore, delay_s: float) -> None:
        self._store = store
        self._delay_s = delay_s
        self.writes = 0

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        self.writes += 1
        if self.writes == 1:
            await asyncio.sleep(self._delay_s)
        return await self._store.write_first(ids, values)

    async def ping(self) -> bool:
        return await self._store.ping()

    async def aclose(self) -> None:
        await self._store.aclose()


async def test_overlapping_publishes_keep_the_call_order_on_the_reply_partition(
    one_partition: tuple[WorkerSettings, ModelTopics, TopicFacts],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    settings, topics, facts = one_partition
    encoder = ResultEncoder(model_name, "v1", "w1")
    store = FirstWriteSlow(open_result_store(settings), delay_s=0.3)
    calls = [[f"{model_name}-{call}-{n}" for n in range(20)] for call in ("first", "second")]
    async with Publisher(settings, topics, facts, encoder, store=store) as publisher:
        first = asyncio.create_task(publisher.publish(_outbox(encoder, calls[0])))
        await asyncio.sleep(0)  # the first call has begun: its Redis write is the slow one
        second = asyncio.create_task(publisher.publish(_outbox(encoder, calls[1])))
        await asyncio.wait_for(asyncio.gather(first, second), 30)

    assert await _reply_keys(kafka_bootstrap, topics.results, 40) == calls[0] + calls[1]
    redis = aioredis.Redis.from_url(redis_url)
    try:
        keys = [result_key(i) for i in calls[0] + calls[1]]
        assert all(value is not None for value in await redis.mget(keys))
        await redis.delete(*keys)
    finally:
        await redis.aclose()


async def test_dead_letters_reach_the_dlq_and_stay_in_the_outbox_to_be_counted(
    one_partition: tuple[WorkerSettings, ModelTopics, TopicFacts],
    kafka_bootstrap: str,
    model_name: str,
) -> None:
    settings, topics, facts = one_partition
    encoder = ResultEncoder(model_name, "v1", "w1")
    outbox = _outbox(encoder, [f"{model_name}-answered"])
    letters = [DeadLetter(f"{model_name}-dead-{n}".encode(), b"payload", []) for n in range(3)]
    outbox.dead.extend(letters)
    async with Publisher(settings, topics, facts, encoder, open_result_store(settings)) as pub:
        await asyncio.wait_for(pub.publish(outbox), 30)

    # The publish stage counts the outbox's dead letters after the call (the metric).
    assert outbox.dead == letters
    assert await _reply_keys(kafka_bootstrap, topics.dlq, 3) == [
        letter.key.decode() for letter in letters if letter.key
    ]


class ClosedOnPing:
    """The real result store, but its first command meets a connection Redis already
    closed (uvloop's error, as when Redis shuts down while the worker starts)."""

    def __init__(self, store: ResultStore) -> None:
        self._store = store
        self.closed = False

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        return await self._store.write_first(ids, values)

    async def ping(self) -> bool:
        raise RuntimeError("unable to perform operation on <TCPTransport>; the handler is closed")

    async def aclose(self) -> None:
        self.closed = True
        await self._store.aclose()


async def test_a_redis_that_closes_the_first_connection_fails_the_start_clearly(
    one_partition: tuple[WorkerSettings, ModelTopics, TopicFacts], model_name: str
) -> None:
    settings, topics, facts = one_partition
    store = ClosedOnPing(open_result_store(settings))
    publisher = Publisher(settings, topics, facts, ResultEncoder(model_name, "v1", "w1"), store)
    with pytest.raises(ConnectFailed, match=r"cannot connect to Redis at .*handler is closed"):
        await publisher.start()
    assert store.closed


@pytest.fixture
async def one_partition(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    drop_topics: list[str],
    model_name: str,
) -> tuple[WorkerSettings, ModelTopics, TopicFacts]:
    """A model's settings, its topics of one partition each (dropped after the test), and
    what the worker learns of them at start."""
    await create_model_topics(client_settings, model_name, partitions=1)
    drop_topics.append(model_name)
    settings = WorkerSettings(
        model="tests:Echo", model_name=model_name, kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url, device="cpu",
    )  # fmt: skip
    topics = topics_for(model_name)
    return settings, topics, await check_topics(settings, topics)


def _outbox(encoder: ResultEncoder, ids: list[str]) -> Outbox:
    outbox = Outbox()
    for request_id in ids:
        value = encoder.encode(request_id, Status.ok, {"n": 1}, None, None)
        outbox.add(request_id, value, encoder.headers(request_id, None), None, 0)
    return outbox


async def _reply_keys(bootstrap: str, topic: str, count: int) -> list[str]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    keys: list[str] = []
    try:
        async with asyncio.timeout(30):
            while len(keys) < count:
                batches = await consumer.getmany(timeout_ms=500)
                keys += [r.key.decode() for rs in batches.values() for r in rs if r.key]
    finally:
        await consumer.stop()
    return keys
