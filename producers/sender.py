"""Send request records to a model's request topic, batched by the Kafka producer.

Before the first record for a model goes out, the topic is looked up in the
cluster metadata: a request sent to a topic no worker reads would never get
an answer, so an unknown topic is an error (``UnknownModel``), not a wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError

from common.security import kafka_failure_cause, kafka_options
from producers.admin import read_max_message_bytes
from producers.errors import RecordTooLarge, ServiceUnavailable, UnknownModel
from producers.settings import ClientSettings
from schemas import OutgoingRecord

# How a broker refuses a record larger than the topic's max.message.bytes.
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


class RequestSender:
    """An idempotent Kafka producer plus a cache of request topics known to exist."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._producer: AIOKafkaProducer | None = None
        self._known_topics: set[str] = set()
        self._starting = asyncio.Lock()

    async def close(self) -> None:
        """Deliver what is buffered, then disconnect."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def send(self, model: str, topic: str, records: Sequence[OutgoingRecord]) -> None:
        """Send ``records`` to ``model``'s request ``topic``; wait until the broker has them all.

        Raises ``UnknownModel`` before sending anything when the topic does not exist.
        """
        producer = await self._started()
        await self._check_topic(producer, model, topic)
        try:
            async with asyncio.timeout(self._settings.send_timeout_s):
                # send() only appends to the producer's batches; the broker sees them
                # a few at a time, one request per partition batch.
                futures = [
                    await producer.send(topic, r.value, key=r.key, headers=r.headers)
                    for r in records
                ]
                await asyncio.gather(*futures)
        except TimeoutError:
            raise self._unavailable(
                f"{len(records)} records not acknowledged in {self._settings.send_timeout_s:g} s"
            ) from None
        except _TOO_LARGE:
            raise await self._too_large(topic, records) from None
        except KafkaError as exc:
            raise self._unavailable(str(exc)) from exc

    async def _started(self) -> AIOKafkaProducer:
        async with self._starting:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self._settings.kafka_bootstrap,
                    acks="all",
                    enable_idempotence=True,
                    linger_ms=self._settings.send_linger_ms,
                    max_batch_size=self._settings.send_batch_bytes,
                    max_request_size=self._settings.limits.max_payload_bytes + 1024 * 1024,
                    request_timeout_ms=int(self._settings.send_timeout_s * 1000),
                    **kafka_options(self._settings),
                )
                try:
                    async with asyncio.timeout(self._settings.connect_timeout_s):
                        await producer.start()
                except (KafkaError, OSError, TimeoutError):
                    await producer.stop()
                    # aiokafka's error only says it could not bootstrap; find out why.
                    cause = await kafka_failure_cause(
                        self._settings.kafka_bootstrap,
                        self._settings,
                        self._settings.connect_timeout_s,
                    )
                    raise self._unavailable(cause) from None
                except BaseException:
                    # Cancelled while connecting: close() would not see this producer.
                    await asyncio.shield(producer.stop())
                    raise
                self._producer = producer
            return self._producer

    async def _check_topic(self, producer: AIOKafkaProducer, model: str, topic: str) -> None:
        if topic in self._known_topics:
            return
        # The producer's own metadata covers topics that existed when it started;
        # a topic created since needs a fresh look. Asking for all topics (not this
        # one) never makes a broker with auto-creation invent it.
        if producer.client.cluster.partitions_for_topic(topic) is None:
            try:
                async with asyncio.timeout(self._settings.connect_timeout_s):
                    cluster = await producer.client.fetch_all_metadata()
            except (KafkaError, TimeoutError) as exc:
                raise self._unavailable(str(exc) or "no metadata in time") from None
            if cluster.partitions_for_topic(topic) is None:
                raise UnknownModel(model, topic)
        self._known_topics.add(topic)

    async def _too_large(self, topic: str, records: Sequence[OutgoingRecord]) -> RecordTooLarge:
        limits = await read_max_message_bytes(self._settings, [topic])
        largest = max(
            len(r.value) + len(r.key) + sum(len(k) + len(v) for k, v in r.headers) for r in records
        )
        return RecordTooLarge(
            topic, largest, limits.get(topic), self._settings.limits.max_record_bytes
        )

    def _unavailable(self, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"cannot reach Kafka at {self._settings.kafka_bootstrap} "
            f"({self._settings.kafka_description}: {why}): is the broker running (`make up`)? "
            "Point the client at it with --kafka-bootstrap or CONVEYOR_KAFKA_BOOTSTRAP, and "
            "check the CONVEYOR_KAFKA_* security settings"
        )
