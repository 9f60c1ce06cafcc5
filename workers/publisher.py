"""Make results durable: Redis first (first final result wins), then the reply topic.

One Redis script call (``workers.store``) and one batch of Kafka sends per call
of ``publish``. A result whose key already exists in Redis (a redelivered request
after a crash) is never overwritten: the stored bytes are re-sent on the reply
topic instead, so both places keep showing the first answer.

Outages are retried with capped backoff and never skipped: ``publish`` returns
only once everything it was given is durable, which is what lets the caller
commit offsets afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from producers.security import kafka_connect_failed, kafka_options, redis_connect_failed
from workers.redis_cluster import open_result_store
from workers.settings import WorkerSettings
from workers.store import ResultStore

log = logging.getLogger(__name__)
T = TypeVar("T")

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0
_TOPIC_CHECK_TIMEOUT_S = 5.0
_UNKNOWN_TOPIC_RECHECK_S = 60.0


@dataclass(slots=True)
class Outgoing:
    """One encoded result, bound for Redis and a reply topic."""

    request_id: str
    data: bytes
    headers: list[tuple[str, bytes]]
    reply_topic: str


@dataclass(slots=True)
class DeadLetter:
    """A copy of a record that could not be served, with the reason in its headers."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass(slots=True)
class PublishReport:
    written: int
    duplicates: int  # results already in Redis (redelivered requests): left unchanged


class Publisher:
    """Writes results to Redis and the reply topic, and dead letters to the DLQ topic."""

    def __init__(self, settings: WorkerSettings, results_topic: str, dlq_topic: str) -> None:
        self._results_topic = results_topic
        self._dlq_topic = dlq_topic
        self._settings = settings
        self._store: ResultStore = open_result_store(settings)
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=settings.worker_id,
            acks="all",
            # Not idempotent on purpose: a retried send may duplicate a reply record,
            # which is harmless (same bytes, same key), while an idempotent producer
            # can end in a fatal sequence error after a broker restart.
            enable_idempotence=False,
            linger_ms=1,
            max_request_size=max(1 << 20, settings.limits.max_payload_bytes + 65536),
            **kafka_options(settings),
        )
        self._known_topics: set[str] = {results_topic, dlq_topic}
        self._unknown_topics: dict[str, float] = {}

    async def start(self) -> None:
        """Connect to Redis and Kafka; raises ``ConnectFailed`` naming the one that refused."""
        try:
            await self._store.ping()
        except (RedisError, OSError) as exc:
            await self._store.aclose()
            raise redis_connect_failed(self._settings.redis_url, exc) from None
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._producer.stop()
            await self._store.aclose()
            bootstrap = self._settings.kafka_bootstrap
            raise await kafka_connect_failed(bootstrap, self._settings, exc) from None

    async def stop(self) -> None:
        try:
            await self._producer.stop()
        finally:
            await self._store.aclose()

    async def ping(self) -> bool:
        """Whether Redis answers now (readiness); raises on a connection error."""
        return await self._store.ping()

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def publish(
        self, results: Sequence[Outgoing], dead: Sequence[DeadLetter]
    ) -> PublishReport:
        """Return once every result is in Redis and acked on Kafka, and every dead letter acked."""
        stored = await _retry("redis", lambda: self._write_redis(results))
        await _retry("kafka", lambda: self._send(results, stored, dead))
        duplicates = sum(
            1 for item, value in zip(results, stored, strict=True) if value is not item.data
        )
        return PublishReport(written=len(results) - duplicates, duplicates=duplicates)

    async def _write_redis(self, results: Sequence[Outgoing]) -> list[bytes]:
        """Write each result unless one exists; return the bytes each key now holds."""
        stored = await self._store.write_first(
            [item.request_id for item in results], [item.data for item in results]
        )
        return [
            item.data if value is None else value
            for item, value in zip(results, stored, strict=True)
        ]

    async def _send(
        self, results: Sequence[Outgoing], stored: Sequence[bytes], dead: Sequence[DeadLetter]
    ) -> None:
        futures = []
        for item, value in zip(results, stored, strict=True):
            topic = await self._reply_topic(item.reply_topic)
            futures.append(
                await self._producer.send(
                    topic, value, key=item.request_id.encode(), headers=item.headers
                )
            )
        for letter in dead:
            futures.append(
                await self._producer.send(
                    self._dlq_topic, letter.value, key=letter.key, headers=letter.headers
                )
            )
        await asyncio.gather(*futures)

    async def _reply_topic(self, topic: str) -> str:
        """The requested reply topic if it exists, else the model's results topic.

        With automatic topic creation off, a send to a missing topic would block for
        the producer's whole request timeout; checking once (and caching) keeps one
        bad ``ce_replyto`` from stalling everyone's results.
        """
        if topic in self._known_topics:
            return topic
        checked_at = self._unknown_topics.get(topic)
        if checked_at is not None and time.monotonic() - checked_at < _UNKNOWN_TOPIC_RECHECK_S:
            return self._results_topic
        try:
            await asyncio.wait_for(self._producer.partitions_for(topic), _TOPIC_CHECK_TIMEOUT_S)
        except (TimeoutError, KafkaError):
            log.warning(
                "reply topic %r does not exist; sending its replies to %s",
                topic,
                self._results_topic,
            )
            self._unknown_topics[topic] = time.monotonic()
            return self._results_topic
        self._known_topics.add(topic)
        return topic


async def _retry(what: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run ``attempt`` until it succeeds, backing off (capped) between outage errors.

    Never gives up: results that are not durable must not be skipped, and the
    worker's backpressure pauses consumption while this waits.
    """
    delay = _BACKOFF_START_S
    while True:
        try:
            return await attempt()
        except (RedisError, KafkaError, OSError) as exc:
            log.warning("%s unavailable (%s); retrying in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
