"""Make results durable: Redis first (first final result wins), then the reply topic.

One ``publish`` call writes a whole outbox: one script call on the result store
(``workers.store``) and one producer batch per reply partition, all acknowledged
(``acks=all``) before it returns, which is what lets the caller commit offsets
afterwards. A result whose id already had one in Redis (a redelivered request)
is never overwritten: the stored bytes go to the reply topic instead, so both
places keep showing the first answer.

Placement on the reply topic: a request's result goes to partition
``p mod N`` of its reply topic, where ``p`` is the request's partition and ``N``
the reply topic's partition count. Results of one request partition (and so of
one video stream, whose frames share a partition) stay in order on one reply
partition, and no per-record hashing is needed.

Errors are sorted by what retrying can do (``workers.publish_errors``): outages
are retried without end while consumption pauses, configuration errors end the
worker after a grace, and a record the broker refuses as too large is handled
here: a dead-letter copy is cut to fit (its original size and SHA-256 in
headers), and a result is replaced on the reply topic by a ``result_too_large``
error (results are sized against the results topic before they are written, so
only a ``ce_replyto`` topic with a smaller limit gets there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
)
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from common.security import kafka_connect_failed, kafka_options, redis_connect_failed
from schemas import ErrorCode, ModelTopics, Status
from schemas.dlq import truncated
from schemas.fastpath import ResultEncoder
from workers.metrics import Metrics
from workers.publish_errors import Failures
from workers.redis_cluster import open_result_store
from workers.settings import WorkerSettings
from workers.store import ResultStore
from workers.topics import TopicFacts, max_message_bytes
from workers.types import DeadLetter, Outbox, PublishReport

log = logging.getLogger(__name__)
T = TypeVar("T")

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0
_TOPIC_CHECK_TIMEOUT_S = 5.0
_UNKNOWN_TOPIC_RECHECK_S = 60.0
_BATCH_BYTES = 512 * 1024  # fill a producer batch up to this (or the topic's limit)
_RECORD_OVERHEAD = 512  # record and batch framing beside key, value and headers
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)
_KAFKA_CONFIG = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError)
_REDIS_CONFIG = (NoPermissionError, AuthenticationError)


class Publisher:
    """Writes results to Redis and the reply topic, and dead letters to the DLQ topic."""

    def __init__(
        self,
        settings: WorkerSettings,
        topics: ModelTopics,
        facts: TopicFacts,
        encoder: ResultEncoder,
        store: ResultStore | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics
        self._settings = settings
        self._results_topic = topics.results
        self._dlq_topic = topics.dlq
        self._store = store or open_result_store(settings)
        results_limit = max_message_bytes(facts, topics.results)
        self._dlq_limit = max_message_bytes(facts, topics.dlq)
        self.max_result_bytes = results_limit - _RECORD_OVERHEAD - 1024  # 1 KiB of headers
        """The largest result document the results topic takes, with its headers."""
        self._producer_options: dict[str, Any] = {
            "bootstrap_servers": settings.kafka_bootstrap,
            "client_id": settings.worker_id,
            "acks": "all",
            "linger_ms": 0,  # batches are built here, whole; nothing to wait for
            "max_batch_size": min(_BATCH_BYTES, results_limit),
            "max_request_size": max(results_limit, self._dlq_limit, 1 << 20) + 65536,
            **kafka_options(settings),
        }
        # Not idempotent on purpose: a retried send may duplicate a reply record,
        # which is harmless (same bytes, same key), while an idempotent producer
        # can end in a fatal sequence error after a broker restart.
        self._producer = AIOKafkaProducer(**self._producer_options, enable_idempotence=False)
        self._partitions: dict[str, int] = {
            name: count for name, count in facts.partitions.items() if name != topics.requests
        }
        self._unknown_topics: dict[str, float] = {}
        self._failures = Failures(settings.permanent_error_grace_s)
        self._encoder = encoder  # for result_too_large errors in place of refused records

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

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def ping(self) -> bool:
        """Whether Redis answers now (readiness); raises on a connection error."""
        return await self._store.ping()

    def stalled_for(self) -> float:
        """Seconds results have been failing to become durable (0 while they do)."""
        return self._failures.stalled_for()

    async def publish(self, outbox: Outbox) -> PublishReport:
        """Return once every result is in Redis and acked on Kafka, and every dead letter acked.

        Raises ``PublishConfigError`` when a configuration error outlasted its grace.
        """
        sent, duplicates = await self.store(outbox.ids, outbox.values)
        groups = await self._groups(outbox)
        producer = self._producer
        await self._failures.retry("kafka", lambda: self._send_all(producer, groups, outbox, sent))
        if outbox.dead:
            await self._failures.retry("kafka", lambda: self._dead_letters(producer, outbox.dead))
        return PublishReport(duplicates=duplicates)

    async def store(self, ids: Sequence[str], values: Sequence[bytes]) -> tuple[list[bytes], int]:
        """Write results to Redis, first result wins (retried through outages).

        Returns the values for the reply topic (the stored bytes where an id already had
        an answer) and how many ids had one.
        """
        stored = await self._failures.retry("redis", lambda: self._store.write_first(ids, values))
        if all(first is None for first in stored):
            return list(values), 0
        sent = [
            mine if first is None else first for mine, first in zip(values, stored, strict=True)
        ]
        return sent, sum(1 for first in stored if first is not None)

    async def send(
        self, producer: AIOKafkaProducer, outbox: Outbox, values: Sequence[bytes]
    ) -> None:
        """One attempt at writing every result (``values``) and dead letter of ``outbox``
        through ``producer``, e.g. inside a transaction; raises the first error."""
        await self._send_all(producer, await self._groups(outbox), outbox, values)
        await self._dead_letters(producer, list(outbox.dead))

    def transactional_producer(self, transactional_id: str, timeout_ms: int) -> AIOKafkaProducer:
        """A producer sized as this publisher's, for transactions under ``transactional_id``."""
        return AIOKafkaProducer(
            **self._producer_options,
            transactional_id=transactional_id,
            transaction_timeout_ms=timeout_ms,
        )

    def note_failure(self, what: str, exc: BaseException) -> None:
        """A write failed outside ``publish`` (a transaction): counts for readiness and, for a
        configuration error past its grace, raises ``PublishConfigError``."""
        self._failures.failed(what, exc)

    def note_success(self) -> None:
        """Writes outside ``publish`` succeed again."""
        self._failures.succeeded()

    # -- the reply topic ------------------------------------------------------------------

    async def _groups(self, outbox: Outbox) -> dict[tuple[str, int], list[int]]:
        """Indices of ``outbox``'s results by reply topic and partition."""
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, (reply_to, partition) in enumerate(
            zip(outbox.reply_to, outbox.partitions, strict=True)
        ):
            topic = self._results_topic if reply_to is None else await self._reply_topic(reply_to)
            groups[(topic, partition % self._partitions[topic])].append(i)
        return groups

    async def _send_all(
        self,
        producer: AIOKafkaProducer,
        groups: dict[tuple[str, int], list[int]],
        outbox: Outbox,
        values: Sequence[bytes],
    ) -> None:
        """Send every group as producer batches; groups acknowledged are removed, so a
        retry after an outage sends only what is left."""
        pending = []
        for (topic, partition), indices in groups.items():
            for batch in self._batches(producer, indices, outbox, values):
                pending.append(((topic, partition), batch))
        results = await asyncio.gather(
            *(
                self._send_batch(producer, batch, topic, partition)
                for (topic, partition), (batch, _) in pending
            ),
            return_exceptions=True,
        )
        failed: dict[tuple[str, int], list[int]] = defaultdict(list)
        first_error: BaseException | None = None
        for ((topic, partition), (_, indices)), result in zip(pending, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if isinstance(result, _TOO_LARGE):
                await self._refused_as_too_large(
                    producer, topic, partition, indices, outbox, values
                )
                continue
            failed[(topic, partition)].extend(indices)
            first_error = first_error or result
        groups.clear()
        groups.update(failed)
        if first_error is not None:
            raise first_error

    async def _send_batch(
        self, producer: AIOKafkaProducer, batch: Any, topic: str, partition: int
    ) -> None:
        """Queue one producer batch and wait for the broker's acknowledgement."""
        delivered = await producer.send_batch(batch, topic, partition=partition)
        await delivered

    def _batches(
        self,
        producer: AIOKafkaProducer,
        indices: list[int],
        outbox: Outbox,
        values: Sequence[bytes],
    ) -> list[tuple[Any, list[int]]]:
        batches = []
        members: list[int] = []
        batch = producer.create_batch()
        ids, headers = outbox.ids, outbox.headers
        for i in indices:
            key = ids[i].encode()
            if batch.append(key=key, value=values[i], timestamp=None, headers=headers[i]) is None:
                batches.append((batch, members))
                batch, members = producer.create_batch(), []
                batch.append(key=key, value=values[i], timestamp=None, headers=headers[i])
            members.append(i)
        batches.append((batch, members))
        return batches

    async def _refused_as_too_large(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        partition: int,
        indices: list[int],
        outbox: Outbox,
        values: Sequence[bytes],
    ) -> None:
        """The broker refused a batch as too large: send its records one by one, and put
        a ``result_too_large`` error in place of any record it refuses alone."""
        for i in indices:
            key = outbox.ids[i].encode()
            try:
                await self._send_one(producer, topic, partition, key, values[i], outbox.headers[i])
            except _TOO_LARGE:
                log.error(
                    "reply topic %s refused the %d-byte result of %s as too large; "
                    "sending a result_too_large error there instead (Redis keeps the answer)",
                    topic,
                    len(values[i]),
                    outbox.ids[i],
                )
                error = self._encoder.encode(
                    outbox.ids[i],
                    Status.error,
                    None,
                    (
                        ErrorCode.result_too_large.value,
                        f"the answer is {len(values[i])} bytes, more than topic {topic} "
                        "accepts; read it from Redis, or raise the topic's max.message.bytes",
                    ),
                    None,
                )
                await self._send_one(producer, topic, partition, key, error, outbox.headers[i])

    async def _send_one(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        partition: int | None,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes | None]],
    ) -> None:
        future = await producer.send(
            topic, value, key=key, partition=partition, headers=list(headers)
        )
        await future

    async def _reply_topic(self, topic: str) -> str:
        """The requested reply topic if it exists, else the model's results topic.

        With automatic topic creation off, a send to a missing topic would wait for
        the producer's whole request timeout; checking once (and caching) keeps one bad
        ``ce_replyto`` from stalling everyone's results. The fallback is documented
        (docs/contract.md) and counted (``conveyor_reply_topic_fallbacks_total``).
        """
        if topic in self._partitions:
            return topic
        checked_at = self._unknown_topics.get(topic)
        if checked_at is None or time.monotonic() - checked_at >= _UNKNOWN_TOPIC_RECHECK_S:
            try:
                partitions = await asyncio.wait_for(
                    self._producer.partitions_for(topic), _TOPIC_CHECK_TIMEOUT_S
                )
            except (TimeoutError, KafkaError):
                partitions = None
            if partitions:
                self._partitions[topic] = len(partitions)
                self._unknown_topics.pop(topic, None)
                return topic
            log.warning(
                "reply topic %r does not exist; sending its replies to %s",
                topic,
                self._results_topic,
            )
            self._unknown_topics[topic] = time.monotonic()
        if self._metrics is not None:
            self._metrics.reply_fallbacks(1)
        return self._results_topic

    # -- dead letters ---------------------------------------------------------------------

    async def _dead_letters(self, producer: AIOKafkaProducer, letters: list[DeadLetter]) -> None:
        """Send every dead letter, cut to fit the topic; acknowledged ones leave the list."""
        while letters:
            letter = self._fit(letters[0])
            try:
                await self._send_one(
                    producer, self._dlq_topic, None, letter.key, letter.value, letter.headers
                )
            except _TOO_LARGE:
                # The topic's limit is lower than it said at start-up: keep headers only.
                log.error("dead-letter topic refused a copy as too large; sending it empty")
                value, cut = truncated(letter.value or b"", 0)
                headers = [*letter.headers, *cut]
                await self._send_one(producer, self._dlq_topic, None, letter.key, value, headers)
            letters.pop(0)

    def _fit(self, letter: DeadLetter) -> DeadLetter:
        """The letter, its value cut to what the dead-letter topic accepts if need be."""
        value = letter.value
        if value is None:
            return letter
        others = sum(len(n) + len(v or b"") for n, v in letter.headers) + len(letter.key or b"")
        room = self._dlq_limit - _RECORD_OVERHEAD - others - 256  # 256: the two size headers
        if len(value) <= room:
            return letter
        cut, headers = truncated(value, room)
        log.warning(
            "dead-letter copy of %d bytes cut to %d to fit topic %s",
            len(value),
            len(cut),
            self._dlq_topic,
        )
        return DeadLetter(letter.key, cut, [*letter.headers, *headers])
