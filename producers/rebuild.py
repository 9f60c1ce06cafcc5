"""Rebuild the Redis result cache from a model's reply topic, after Redis lost its data.

Every result a worker writes to Redis it also writes, the same bytes, to the
model's reply topic (key = request id). ``rebuild_results`` reads that topic
from the beginning up to the end offsets it finds at start (``read_committed``:
never a result of an aborted transaction) and writes each result back the way
the worker's result script does (``workers.store``): ``SET
conveyor:result:<id> <bytes> NX`` with an expiry, and ``PUBLISH`` on the key's
channel when that created the key, in one script call per batch.

- **First final result per id wins.** A request's results share a reply
  partition and are read in its order; ``NX`` keeps the first, and never
  replaces a result Redis still holds.
- **Time to live from the result's own time.** A result expires ``ttl_s`` after
  the worker stored it (``timings.published_ms``; ``finished_ms`` in documents
  of older workers): one whose time is up is skipped, the others get what is
  left of it, to the millisecond.
- **Idempotent.** A second run finds every key there and changes nothing.

Only a standalone Redis: a Redis Cluster's keys of one batch fall in many slots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from common.security import kafka_options, redis_options
from producers.errors import ClientError, InvalidInput, ServiceUnavailable, UnknownModel
from producers.settings import ClientSettings
from schemas import result_key, topics_for

__all__ = ["REBUILD_SCRIPT", "RebuildReport", "rebuild_results"]

REBUILD_SCRIPT = """
local created = 0
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[2 * i - 1], 'NX', 'PX', ARGV[2 * i]) then
    redis.call('PUBLISH', key, '')
    created = created + 1
  end
end
return created
"""
"""KEYS: result keys; ARGV[2i-1]: the value for KEYS[i], ARGV[2i]: its time to live in ms.
``workers.store.WRITE_FIRST_SCRIPT`` with a time to live per key. Returns how many it created."""

RESULT_TYPE = b"conveyor.result.v1"
_BATCH = 1000  # results per script call: one round trip, a short pause for Redis
_FETCH_MS = 1000


@dataclass
class RebuildReport:
    """What a rebuild did, counted in records of the reply topic."""

    read: int = 0
    written: int = 0
    """Results written to Redis (their keys were missing)."""
    present: int = 0
    """Results whose key Redis already held: kept as they are (a later copy of an id, too)."""
    expired: int = 0
    """Results whose time to live was up: skipped."""
    skipped: int = 0
    """Records that are not results of this contract (no id key, not a result document)."""


Progress = Callable[[int], None]
"""Told a number of records: how many there are to read, or how many more were read."""


async def rebuild_results(
    settings: ClientSettings,
    model: str,
    ttl_s: int,
    *,
    topic: str | None = None,
    on_progress: Progress | None = None,
    on_total: Progress | None = None,
) -> RebuildReport:
    """Write every result of ``model``'s reply topic (or ``topic``) that Redis lacks.

    ``ttl_s`` is the workers' ``--result-ttl-s``. ``on_total`` is told how many records
    will be read, ``on_progress`` how many more were, after each batch. Raises
    ``UnknownModel`` when the topic does not exist, ``ServiceUnavailable`` when Kafka
    or Redis cannot be reached, ``InvalidInput`` for a Redis Cluster.
    """
    if settings.redis_cluster:
        raise InvalidInput(
            "conveyor results rebuild writes to a standalone Redis; a Redis Cluster is not "
            "supported yet"
        )
    if ttl_s < 1:
        raise InvalidInput(f"the result time to live must be at least 1 s, not {ttl_s}")
    try:
        name = topic if topic is not None else topics_for(model, settings.topic_prefix).results
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    redis = aioredis.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_connect_timeout=settings.connect_timeout_s,
        socket_timeout=settings.connect_timeout_s,
        client_name=settings.redis_client_name,
        **redis_options(settings),
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=None,  # commits nothing, takes no partitions from anyone
        enable_auto_commit=False,
        # Results of transactions that workers in exactly-once delivery aborted were
        # never stored in Redis either.
        isolation_level="read_committed",
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
        **kafka_options(settings),
    )
    try:
        ends = await _start(consumer, settings, model, name)
        if on_total is not None:
            on_total(sum(end - start for start, end in ends.values()))
        writer = _Writer(redis, settings, ttl_s)
        await writer.ping()
        return await _copy(consumer, ends, writer, on_progress)
    finally:
        await consumer.stop()
        await redis.aclose()


async def _start(
    consumer: AIOKafkaConsumer, settings: ClientSettings, model: str, topic: str
) -> dict[TopicPartition, tuple[int, int]]:
    """Every partition of ``topic`` assigned from its start; its (start, end) offsets as now."""
    try:
        async with asyncio.timeout(settings.connect_timeout_s):
            await consumer.start()
            # A fresh look: the consumer's public topics() gives names only.
            cluster = await consumer._client.fetch_all_metadata()
            partitions = cluster.partitions_for_topic(topic)
            if not partitions:
                raise UnknownModel(model, topic)
            assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign(assigned)
            starts = await consumer.beginning_offsets(assigned)
            # read_committed: the last stable offset, so no open transaction is waited for.
            ends = await consumer.end_offsets(assigned)
    except (KafkaError, OSError, TimeoutError) as exc:
        raise ServiceUnavailable(
            f"cannot read {topic} from Kafka at {settings.kafka_bootstrap} "
            f"({exc or 'no answer in time'}): is it running (`make up`)?"
        ) from None
    for tp in assigned:
        consumer.seek(tp, starts[tp])
    return {tp: (starts[tp], ends[tp]) for tp in assigned}


async def _copy(
    consumer: AIOKafkaConsumer,
    ends: dict[TopicPartition, tuple[int, int]],
    writer: _Writer,
    on_progress: Progress | None,
) -> RebuildReport:
    report = RebuildReport()
    left = {tp: end for tp, (start, end) in ends.items() if end > start}
    if not left:
        return report
    consumer.pause(*[tp for tp in ends if tp not in left])
    while left:
        try:
            fetched = await consumer.getmany(*left, timeout_ms=_FETCH_MS, max_records=_BATCH)
        except KafkaError as exc:
            raise ServiceUnavailable(f"reading the reply topic failed: {exc}") from None
        batch: list[ConsumerRecord[bytes, bytes]] = []
        for tp, records in fetched.items():
            end = left.get(tp)
            if end is None:
                continue
            batch.extend(r for r in records if r.offset < end)
            if records and records[-1].offset >= end - 1:
                del left[tp]
                consumer.pause(tp)
        for tp in list(left):  # control records and aborted ones move the position too
            if await consumer.position(tp) >= left[tp]:
                del left[tp]
                consumer.pause(tp)
        await writer.write(batch, report)
        report.read += len(batch)
        if on_progress is not None and batch:
            on_progress(len(batch))
    return report


class _Writer:
    """Writes batches of results with ``REBUILD_SCRIPT``, each with what is left of its TTL."""

    def __init__(self, redis: aioredis.Redis, settings: ClientSettings, ttl_s: int) -> None:
        self._redis = redis
        self._settings = settings
        self._ttl_ms = ttl_s * 1000
        self._script = redis.register_script(REBUILD_SCRIPT)

    async def ping(self) -> None:
        await self._call(self._redis.ping())

    async def write(
        self, records: Sequence[ConsumerRecord[bytes, bytes]], report: RebuildReport
    ) -> None:
        keys: list[str] = []
        args: list[bytes | int] = []
        now_ms = time.time() * 1000
        for record in records:
            found = _result_of(record)
            if found is None:
                report.skipped += 1
                continue
            request_id, stored_ms = found
            left_ms = int(self._ttl_ms - (now_ms - stored_ms))
            if left_ms <= 0:
                report.expired += 1
                continue
            keys.append(result_key(request_id))
            args += [record.value or b"", left_ms]
        if not keys:
            return
        created = await self._call(self._script(keys=keys, args=args))
        report.written += int(created)
        report.present += len(keys) - int(created)

    async def _call(self, operation: Any) -> Any:
        settings = self._settings
        try:
            async with asyncio.timeout(settings.connect_timeout_s * 2):
                return await operation
        except (RedisConnectionError, OSError, TimeoutError) as exc:
            raise ServiceUnavailable(
                f"cannot reach Redis at {settings.redis_location} "
                f"({exc or 'no answer in time'}): is it running (`make up`)?"
            ) from None
        except RedisError as exc:  # refused: NOPERM, a read-only replica, out of memory
            raise ClientError(
                f"Redis at {settings.redis_location} refused the write: {exc}"
            ) from None


def _result_of(record: ConsumerRecord[bytes, bytes]) -> tuple[str, float] | None:
    """The request id and store time (epoch ms) of a result record; None for anything else."""
    for name, value in record.headers:
        if name == "ce_type" and value != RESULT_TYPE:
            return None
    if record.key is None or record.value is None:
        return None
    try:
        document = orjson.loads(record.value)
        request_id = record.key.decode()
        result_key(request_id)  # a valid id, or ContractError
    except (orjson.JSONDecodeError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("id") != request_id:
        return None
    timings = document.get("timings")
    stored = None
    if isinstance(timings, dict):
        stored = timings.get("published_ms") or timings.get("finished_ms")
    if not isinstance(stored, int | float):
        stored = record.timestamp  # the worker's send time: a moment after the store
    return request_id, float(stored)
