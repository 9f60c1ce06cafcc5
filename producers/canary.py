"""A model's canary from outside the workers: set its share, see where the groups are.

``set_canary_share`` writes a canary marker (``schemas.canary``) to every partition
of every request topic of the model (its priority lanes' too), acknowledged by every
replica: from each marker on, the canary group (``<prefix>.<model>.canary``) answers
the share of requests whose bucket falls below it and the primary group the rest.
Requests already in the topics before a marker keep the share they were sent under,
however far behind the workers are, so widening, narrowing or ending a canary
(share 0) never leaves a request to both groups or to neither.

A canary group that has never committed a position on a partition (its workers have
not run yet) is placed at the new markers, with the share before them as the
commit's metadata: its workers start exactly where its share begins. That commit is
refused while the group has members, so the share is set before the canary's
workers start (they refuse to start without a position, saying so).

``canary_status`` reads where both groups are: per request partition, the committed
position, the share in effect there (the commit's metadata) and the records behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    KafkaError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)

from common.security import kafka_options
from producers.errors import ClientError, InvalidInput, ServiceUnavailable, UnknownModel
from producers.settings import ClientSettings
from schemas import Role, consumer_group, topics_for
from schemas.canary import BUCKETS, canary_marker, commit_note, read_note, share_points

__all__ = ["CanaryReport", "GroupPosition", "canary_status", "set_canary_share"]

# What a commit outside the group gets while the group has members.
_MEMBERS = (
    CommitFailedError,
    IllegalGenerationError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)


@dataclass(frozen=True)
class CanaryReport:
    """What ``set_canary_share`` wrote."""

    share: float  # the fraction set, as the markers carry it
    markers: dict[str, int]  # "topic[partition]" -> the marker's offset
    placed: list[str] = field(default_factory=list)
    """Partitions ("topic[partition]") where the canary group was placed at the marker."""
    canary_workers: int = 0
    """Members of the canary group when the markers were written: with none, its share
    waits in the topics until one starts."""


@dataclass(frozen=True)
class GroupPosition:
    """One group on one request partition."""

    group: str
    partition: str  # "topic[partition]"
    committed: int | None  # None: the group never committed there
    share: float  # the canary share in effect at ``committed``
    behind: int | None  # records from ``committed`` to the end of the partition


async def set_canary_share(
    settings: ClientSettings, model: str, share: float, source: str = "conveyor-canary"
) -> CanaryReport:
    """Give the canary ``share`` (a fraction, 0 to 1) of the requests sent from now on.

    Raises ``InvalidInput`` for a share outside 0 to 1 or a bad model name,
    ``UnknownModel`` when the model has no request topic, ``ServiceUnavailable`` when
    Kafka cannot be reached, ``ClientError`` when the canary group must be placed while
    it has members.
    """
    try:
        points = share_points(share)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    group = _group(settings, model, "canary")
    async with _admin(settings) as admin:
        partitions = await _request_partitions(admin, settings, model)
        committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
        members = await _members(admin, group)
    unplaced = [tp for tp in partitions if tp not in committed or committed[tp].offset < 0]
    markers = await _write_markers(settings, partitions, points, source)
    if unplaced:
        await _place(settings, group, {tp: markers[tp] for tp in unplaced})
    return CanaryReport(
        points / BUCKETS,
        {_name(tp): offset for tp, offset in sorted(markers.items())},
        [_name(tp) for tp in sorted(unplaced)],
        members,
    )


async def canary_status(settings: ClientSettings, model: str) -> list[GroupPosition]:
    """Where the primary and the canary group are on each request partition of ``model``."""
    async with _admin(settings) as admin:
        partitions = await _request_partitions(admin, settings, model)
        ends = await _end_offsets(settings, partitions)
        positions = []
        for role in ("primary", "canary"):
            group = _group(settings, model, role)
            committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
            for tp in partitions:
                found = committed.get(tp)
                offset = None if found is None or found.offset < 0 else found.offset
                note = None if offset is None or found is None else found.metadata
                positions.append(
                    GroupPosition(
                        group,
                        _name(tp),
                        offset,
                        read_note(note) / BUCKETS,
                        None if offset is None else max(0, ends[tp] - offset),
                    )
                )
    return positions


# -- Kafka -------------------------------------------------------------------------------------


@asynccontextmanager
async def _admin(settings: ClientSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client, started; Kafka's failures inside are ``ServiceUnavailable``."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap,
        request_timeout_ms=int(settings.connect_timeout_s * 1000),
        **kafka_options(settings),
    )
    try:
        async with asyncio.timeout(settings.connect_timeout_s * 3):
            await admin.start()
        yield admin
    except (KafkaError, OSError, TimeoutError) as exc:
        raise _unavailable(settings, exc) from None
    finally:
        await admin.close()


async def _request_partitions(
    admin: AIOKafkaAdminClient, settings: ClientSettings, model: str
) -> list[TopicPartition]:
    """Every partition of the model's request topics: the plain one and each lane's."""
    try:
        topics = topics_for(model, settings.topic_prefix)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    names = [
        name
        for name in await admin.list_topics()
        if name == topics.requests
        or (name.startswith(f"{topics.requests}.") and "." not in name[len(topics.requests) + 1 :])
    ]
    if topics.requests not in names:
        raise UnknownModel(model, topics.requests)
    described = await admin.describe_topics(sorted(names))
    return sorted(
        TopicPartition(str(topic["topic"]), int(part["partition"]))
        for topic in described
        for part in topic["partitions"]
    )


async def _members(admin: AIOKafkaAdminClient, group: str) -> int:
    """How many members ``group`` has now."""
    responses = await admin.describe_consumer_groups([group])
    return sum(
        len(found["members"])
        for response in responses
        for found in response.to_object()["groups"]
        if found["group"] == group
    )


async def _write_markers(
    settings: ClientSettings, partitions: list[TopicPartition], points: int, source: str
) -> dict[TopicPartition, int]:
    """A marker of share ``points`` on each partition; the offset each one got."""
    record = canary_marker(points / BUCKETS, source)
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap, acks="all", **kafka_options(settings)
    )
    try:
        await producer.start()
        sent = [
            await producer.send(
                tp.topic,
                record.value,
                key=record.key,
                headers=record.headers,
                partition=tp.partition,
            )
            for tp in partitions
        ]
        acked = await asyncio.gather(*sent)
    except (KafkaError, OSError) as exc:
        raise _unavailable(settings, exc) from None
    finally:
        await producer.stop()
    return {tp: int(meta.offset) for tp, meta in zip(partitions, acked, strict=True)}


async def _place(
    settings: ClientSettings, group: str, positions: dict[TopicPartition, int]
) -> None:
    """Commit ``positions`` for ``group``, which must have no members (its workers have
    not started): the share before each marker is 0 there, the marker sets its own."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        **kafka_options(settings),
    )
    try:
        await consumer.start()
        consumer.assign(list(positions))
        await consumer.commit({tp: (offset, commit_note(0)) for tp, offset in positions.items()})
    except _MEMBERS:
        raise ClientError(
            f"the canary group {group} has members but no position on "
            f"{', '.join(_name(tp) for tp in sorted(positions))}: stop the canary's workers, "
            "then set the share again (it places the group at the new markers)"
        ) from None
    except (KafkaError, OSError) as exc:
        raise _unavailable(settings, exc) from None
    finally:
        await consumer.stop()


async def _end_offsets(
    settings: ClientSettings, partitions: list[TopicPartition]
) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **kafka_options(settings),
    )
    try:
        await consumer.start()
        ends = await consumer.end_offsets(partitions)
    except (KafkaError, OSError) as exc:
        raise _unavailable(settings, exc) from None
    finally:
        await consumer.stop()
    return {tp: int(offset) for tp, offset in ends.items()}


def _group(settings: ClientSettings, model: str, role: Role) -> str:
    try:
        return consumer_group(model, settings.topic_prefix, role)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _name(tp: TopicPartition) -> str:
    return f"{tp.topic}[{tp.partition}]"


def _unavailable(settings: ClientSettings, exc: BaseException) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"cannot reach Kafka at {settings.kafka_bootstrap} ({exc or 'no answer in time'}): "
        "is it running (`make up`)?"
    )
