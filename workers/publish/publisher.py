"""Make results durable: Redis first (first final result wins), then the reply topic.

One ``publish`` call writes a whole outbox: one script call on the result store
(``workers.publish.result_store``) and one producer batch per reply partition, all acknowledged
(``acks=all``) before it returns, which is what lets the caller commit offsets
afterwards. Calls may overlap (``workers.delivery.stage``): each queues its records
after those of the calls begun before it. A result whose id already had one in
Redis (a redelivered request) is never overwritten: the stored bytes go to the
reply topic instead, so both places keep showing the first answer.

Placement on the reply topic: a request's result goes to partition
``p mod N`` of its reply topic, where ``p`` is the request's partition and ``N``
the reply topic's partition count. Results of one request partition (and so of
one video stream, whose frames share a partition) stay in order on one reply
partition, and no per-record hashing is needed.

Errors are sorted by what retrying can do (``workers.publish.errors``): outages
are retried without end while consumption pauses, configuration errors end the
worker after a grace, and a record the broker refuses as too large is handled:
a dead-letter copy is cut to fit (``workers.publish.dead_letters``), and a result is
replaced on the reply topic by a ``result_too_large`` error (results are sized
against the results topic before they are written, so only a ``ce_replyto``
topic with a smaller limit gets there).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from common.security import (
    kafka_connect_failed,
    kafka_options,
    redis_connect_failed,
    redis_location,
)
from schemas import ErrorCode, ModelTopics, Status
from schemas.fastpath import ResultEncoder
from workers.config.worker import WorkerSettings
from workers.kafka.topics import TopicFacts, max_message_bytes
from workers.observe.metrics import Metrics
from workers.publish.cluster_store import open_result_store
from workers.publish.dead_letters import RECORD_OVERHEAD, TOO_LARGE, DeadLetters, send_one
from workers.publish.errors import Failures, WriteRefused, is_outage, refused_at_start
from workers.publish.result_store import ResultStore
from workers.types import Outbox, PublishReport, Request

log = logging.getLogger(__name__)

T = TypeVar("T")

_TOPIC_CHECK_TIMEOUT_S = 5.0
_UNKNOWN_TOPIC_RECHECK_S = 60.0
_BATCH_BYTES = 512 * 1024  # fill a producer batch up to this (or the topic's limit)
_STOP_TIMEOUT_S = 5.0  # workers.app.CLOSE_S leaves room for this and the consumer's


class _Queued(NamedTuple):
    """A producer batch of results handed to the producer, or refused on the way."""

    topic: str
    partition: int
    members: list[int]  # the outbox's indices of its results
    acked: asyncio.Future[Any] | Exception  # done once the broker acknowledged it


async def _send_requests(producer: AIOKafkaProducer, requests: Sequence[Request]) -> None:
    """Send a pipeline's child requests (``workers.chain``), one producer batch per
    partition as far as they fit, and wait for every acknowledgement."""
    by_partition: dict[tuple[str, int], list[Request]] = defaultdict(list)
    for request in requests:
        by_partition[(request.topic, request.partition)].append(request)
    acks = []
    for (topic, partition), members in by_partition.items():
        batch = producer.create_batch()
        for r in members:
            if batch.append(key=r.key, value=r.value, timestamp=None, headers=r.headers) is None:
                acks.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                batch.append(key=r.key, value=r.value, timestamp=None, headers=r.headers)
        acks.append(await producer.send_batch(batch, topic, partition=partition))
    await asyncio.gather(*acks)


async def _acked(acked: asyncio.Future[Any] | Exception) -> None:
    if isinstance(acked, Exception):
        raise acked
    await acked


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
        self._store = store or open_result_store(settings)
        results_limit = max_message_bytes(facts, topics.results)
        self._dead_letters = DeadLetters(topics.dlq, max_message_bytes(facts, topics.dlq))
        self.max_result_bytes = results_limit - RECORD_OVERHEAD - 1024  # 1 KiB of headers
        """The largest result document the results topic takes, with its headers."""
        self._producer_options: dict[str, Any] = {
            "bootstrap_servers": settings.kafka_bootstrap,
            "client_id": settings.worker_id,
            "acks": "all",
            "linger_ms": 0,  # batches are built here, whole; nothing to wait for
            "max_batch_size": min(_BATCH_BYTES, results_limit),
            "max_request_size": max(results_limit, self._dead_letters.limit, 1 << 20) + 65536,
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
        self._queued: asyncio.Future[None] | None = None  # done once the last call queued
        # When each write still waiting on Kafka's acknowledgements began, by ticket.
        self._awaiting: dict[int, float] = {}
        self._tickets = itertools.count()

    async def start(self) -> None:
        """Connect to Redis and Kafka; raises ``ConnectFailed`` naming the one that could not
        be reached, ``RedisRefused`` naming a grant Redis refused."""
        try:
            await self._store.ping()
        except Exception as exc:
            await self._store.aclose()
            await self._producer.stop()  # made, never started: its client is closed all the same
            if not is_outage(exc):
                raise
            refused = refused_at_start(redis_location(self._settings.redis_url), exc)
            raise refused or redis_connect_failed(self._settings.redis_url, exc) from None
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._producer.stop()
            await self._store.aclose()
            bootstrap = self._settings.kafka_bootstrap
            raise await kafka_connect_failed(bootstrap, self._settings, exc) from None

    async def stop(self) -> None:
        """Close the producer (records it holds are sent, for 5 s at most:
        with the broker down they would wait for its request timeout) and Redis."""
        try:
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await self._producer.stop()
        except TimeoutError:
            log.warning("the producer did not stop in %.0f s", _STOP_TIMEOUT_S)
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
        """Seconds results have been failing to become durable (0 while they do): since
        the first of a run of failed writes, or since the oldest write still waiting on
        Kafka began, whichever is longer. A broker that went away fails a write only
        after the producer's request time-out (40 s); its acknowledgements stop at once."""
        oldest = min(self._awaiting.values(), default=None)
        waiting = 0.0 if oldest is None else time.monotonic() - oldest
        return max(self._failures.stalled_for(), waiting)

    @contextlib.contextmanager
    def awaiting_kafka(self) -> Iterator[None]:
        """Count the enclosed writes to Kafka, until they end, in ``stalled_for``."""
        ticket = next(self._tickets)
        self._awaiting[ticket] = time.monotonic()
        try:
            yield
        finally:
            del self._awaiting[ticket]

    @property
    def config_problem(self) -> str | None:
        """Why results cannot become durable until an operator acts, while that lasts."""
        return self._failures.config_problem

    async def publish(self, outbox: Outbox) -> PublishReport:
        """Return once every result is in Redis and acked on Kafka, and every dead letter acked.

        Calls may overlap: each writes to Redis at once, then queues its records for the
        reply topics in the order the calls began (a request partition's results stay in
        order on its reply partition), then waits for its acknowledgements while later
        calls write and queue theirs. Raises ``PublishConfigError`` when a configuration
        error outlasted its grace.
        """
        before, mine = self._queued, asyncio.get_running_loop().create_future()
        self._queued = mine
        producer = self._producer
        try:
            sent, duplicates = await self.store(outbox.ids, outbox.values)
            groups = await self._groups(outbox)
            if before is not None:
                await asyncio.wait([before])  # the call before has queued its records
            queued: list[_Queued] | None = await self._queue(producer, groups, outbox, sent)
        finally:
            mine.set_result(None)

        async def send() -> None:  # the first attempt's records are queued already
            nonlocal queued
            first, queued = queued, None
            await self._send_all(producer, groups, outbox, sent, first)

        with self.awaiting_kafka():
            await self._failures.retry("kafka", send)
            if outbox.dead:
                letters = list(outbox.dead)  # send() empties its list; counted after
                await self._failures.retry(
                    "kafka", lambda: self._dead_letters.send(producer, letters)
                )
            if outbox.requests:
                requests = outbox.requests
                await self._failures.retry("kafka", lambda: _send_requests(producer, requests))
        return PublishReport(duplicates=duplicates)

    async def retried(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, repeated through outages of ``what`` ("redis" or "kafka"), which
        count for readiness as the publisher's own writes do."""
        return await self._failures.retry(what, call)

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
        await self._dead_letters.send(producer, list(outbox.dead))
        await _send_requests(producer, outbox.requests)

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

    async def _queue(
        self,
        producer: AIOKafkaProducer,
        groups: dict[tuple[str, int], list[int]],
        outbox: Outbox,
        values: Sequence[bytes],
    ) -> list[_Queued]:
        """Queue every group as producer batches, one after another: each with its
        acknowledgement to wait for, or the error that kept it out of the queue."""
        queued = []
        for (topic, partition), indices in groups.items():
            for batch, members in self._batches(producer, indices, outbox, values):
                acked: asyncio.Future[Any] | Exception
                try:
                    acked = await producer.send_batch(batch, topic, partition=partition)
                except Exception as exc:  # counted with the acknowledgements' errors
                    acked = exc
                queued.append(_Queued(topic, partition, members, acked))
        return queued

    async def _send_all(
        self,
        producer: AIOKafkaProducer,
        groups: dict[tuple[str, int], list[int]],
        outbox: Outbox,
        values: Sequence[bytes],
        queued: list[_Queued] | None = None,
    ) -> None:
        """Send every group as producer batches (or wait for ``queued``, the groups queued
        already); groups acknowledged are removed, so a retry after an outage sends only
        what is left."""
        if queued is None:
            queued = await self._queue(producer, groups, outbox, values)
        results = await asyncio.gather(*(_acked(q.acked) for q in queued), return_exceptions=True)
        failed: dict[tuple[str, int], list[int]] = defaultdict(list)
        first_error: BaseException | None = None
        for q, result in zip(queued, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if isinstance(result, TOO_LARGE):
                await self._refused_as_too_large(
                    producer, q.topic, q.partition, q.members, outbox, values
                )
                continue
            failed[(q.topic, q.partition)].extend(q.members)
            if isinstance(result, TopicAuthorizationFailedError):
                result = WriteRefused(q.topic)  # the error names no topic: say which
            first_error = first_error or result
        groups.clear()
        groups.update(failed)
        if first_error is not None:
            raise first_error

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
                await send_one(producer, topic, partition, key, values[i], outbox.headers[i])
            except TOO_LARGE:
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
                await send_one(producer, topic, partition, key, error, outbox.headers[i])

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
