"""Create a model's topics: requests (one per priority lane), results and dead letters.

A topic's partition count caps how many workers of a model can share its
work: each partition is read by one worker of the group at a time, so the
request topic needs at least as many partitions as the most workers you
plan to run. Creating is idempotent; existing topics are left as they are.

New topics get ``max.message.bytes`` = ``Limits.max_record_bytes``, so a
payload as large as the contract allows (16 MiB) is accepted, and so is its
copy on the dead-letter topic; Kafka's default (about 1 MB) would refuse it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError

from common.security import kafka_failure_cause, kafka_options
from producers.errors import ClientError, InvalidInput, ServiceUnavailable
from producers.settings import ClientSettings
from schemas import topics_for

_TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error code
MAX_MESSAGE_BYTES = "max.message.bytes"
# Dead letters are rare and have no order to keep: one partition is plenty.
_DLQ_PARTITIONS = 1


@dataclass(frozen=True)
class TopicState:
    """One topic after ``create_model_topics``."""

    name: str
    partitions: int  # what the topic has now, which for an old topic may differ from the ask
    created: bool  # False: it existed already and was left unchanged
    max_message_bytes: int | None  # the topic's max.message.bytes now; None if unreadable


async def create_model_topics(
    settings: ClientSettings,
    model: str,
    partitions: int,
    replication_factor: int = 1,
    lanes: Sequence[str] = (),
) -> list[TopicState]:
    """Create ``model``'s request and result topics with ``partitions`` partitions, and its DLQ;
    with ``lanes``, a request topic per priority lane too (``<requests>.<lane>``).

    Every new topic gets ``max.message.bytes`` from ``settings.limits``. Raises
    ``InvalidInput`` for a bad model name, lane name or count, ``ServiceUnavailable``
    when Kafka cannot be reached, and ``ClientError`` when the broker refuses.
    """
    if partitions < 1 or replication_factor < 1:
        raise InvalidInput("partitions and replication factor must be at least 1")
    try:
        topics = topics_for(model, settings.topic_prefix)
        lane_topics = [topics.lane(lane) for lane in lanes]
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    wanted = {topics.requests: partitions}
    wanted |= dict.fromkeys(lane_topics, partitions)
    wanted |= {topics.results: partitions, topics.dlq: _DLQ_PARTITIONS}
    config = {MAX_MESSAGE_BYTES: str(settings.limits.max_record_bytes)}
    admin = _admin(settings)
    try:
        async with asyncio.timeout(settings.connect_timeout_s * 3):
            await admin.start()
            response = await admin.create_topics(
                [
                    NewTopic(name, count, replication_factor, topic_configs=config)
                    for name, count in wanted.items()
                ]
            )
            created = _check_created(response.topic_errors)
            described = await admin.describe_topics(list(wanted))
            sizes = await _max_message_bytes(admin, list(wanted))
    except KafkaConnectionError:
        # aiokafka's error only says it could not bootstrap; find out why.
        why = await kafka_failure_cause(
            settings.kafka_bootstrap, settings, settings.connect_timeout_s
        )
        raise _unavailable(settings, why) from None
    except (KafkaError, OSError, TimeoutError) as exc:
        raise _unavailable(settings, str(exc) or "no answer in time") from None
    finally:
        await admin.close()
    counts = {topic["topic"]: len(topic["partitions"]) for topic in described}
    return [
        TopicState(name, counts.get(name, 0), name in created, sizes.get(name)) for name in wanted
    ]


async def read_max_message_bytes(settings: ClientSettings, topics: Sequence[str]) -> dict[str, int]:
    """Each topic's ``max.message.bytes``, for error messages: best effort, {} on any failure."""
    admin = _admin(settings)
    try:
        async with asyncio.timeout(settings.connect_timeout_s):
            await admin.start()
            return await _max_message_bytes(admin, topics)
    except (KafkaError, OSError, TimeoutError):
        return {}
    finally:
        await admin.close()


async def _max_message_bytes(admin: AIOKafkaAdminClient, topics: Sequence[str]) -> dict[str, int]:
    resources = [
        ConfigResource(ConfigResourceType.TOPIC, name, {MAX_MESSAGE_BYTES: None}) for name in topics
    ]
    found: dict[str, int] = {}
    for response in await admin.describe_configs(resources):
        for error_code, _message, _type, name, entries in response.resources:
            for key, value, *_rest in entries if error_code == 0 else ():
                if key == MAX_MESSAGE_BYTES and value is not None:
                    found[name] = int(value)
    return found


def _admin(settings: ClientSettings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap,
        request_timeout_ms=int(settings.connect_timeout_s * 1000),
        **kafka_options(settings),
    )


def _unavailable(settings: ClientSettings, why: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"cannot create topics on Kafka at {settings.kafka_bootstrap} "
        f"({settings.kafka_description}: {why}): is the broker "
        "running (`make up`)? Are the CONVEYOR_KAFKA_* security settings right? "
        "Point at it with --kafka-bootstrap or CONVEYOR_KAFKA_BOOTSTRAP"
    )


def _check_created(topic_errors: list[tuple[str, int, str | None]]) -> set[str]:
    """Names created now; raises ``ClientError`` for any failure but "already exists"."""
    created = set()
    for name, code, message in topic_errors:
        if code == 0:
            created.add(name)
        elif code != _TOPIC_ALREADY_EXISTS:
            raise ClientError(f"Kafka refused to create topic {name}: {message} (error {code})")
    return created
