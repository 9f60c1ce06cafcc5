"""Create a model's topics: requests (one per priority lane), results and dead letters.

A topic's partition count caps how many workers of a model can share its
work: each partition is read by one worker of the group at a time, so the
request topic needs at least as many partitions as the most workers you
plan to run. Creating is idempotent; existing topics are left as they are.

New topics get ``max.message.bytes`` = ``Limits.max_record_bytes``, so a
payload as large as the contract allows (16 MiB) is accepted, and so is its
copy on the dead-letter topic; Kafka's default (about 1 MB) would refuse it.
``create_model_topics`` returns once the cluster's metadata names a leader for
every partition, so a producer finds every partition at once (a leader may still
refuse the first records as "not leader" for a moment; producers retry them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
_LEADER_POLL_S = 0.05
_UNKNOWN_TOPIC = 3  # Kafka protocol error code
Role = Literal["requests", "results", "dlq"]
"""What a topic is for; a priority lane's topic is a ``requests`` topic."""


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
    *,
    configs: Mapping[Role, Mapping[str, str]] | None = None,
    leaders: Mapping[Role, int] | None = None,
    shadow: bool = False,
) -> list[TopicState]:
    """Create ``model``'s request and result topics with ``partitions`` partitions, and its DLQ;
    with ``lanes``, a request topic per priority lane too (``<requests>.<lane>``); with
    ``shadow``, the results topic of its shadow workers (``<prefix>.<model>.shadow-results``).

    Every new topic gets ``max.message.bytes`` from ``settings.limits``, and the
    settings ``configs`` names for its role. ``leaders`` names a broker per role
    that leads every partition of those topics (it takes the first replica), so a
    failover test knows which broker to stop. Returns once every partition has a
    leader. Raises ``InvalidInput`` for a bad model name, lane name or count,
    ``ServiceUnavailable`` when Kafka cannot be reached, and ``ClientError`` when
    the broker refuses.
    """
    if partitions < 1 or replication_factor < 1:
        raise InvalidInput("partitions and replication factor must be at least 1")
    try:
        topics = topics_for(model, settings.topic_prefix)
        lane_topics = [topics.lane(lane) for lane in lanes]
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    wanted: dict[str, tuple[Role, int]] = {topics.requests: ("requests", partitions)}
    wanted |= dict.fromkeys(lane_topics, ("requests", partitions))
    wanted[topics.results] = ("results", partitions)
    if shadow:
        wanted[topics.shadow_results] = ("results", partitions)
    wanted[topics.dlq] = ("dlq", _DLQ_PARTITIONS)
    admin = _admin(settings)
    try:
        async with asyncio.timeout(settings.connect_timeout_s * 3):
            await admin.start()
            brokers = await _broker_ids(admin) if leaders else []
            new = [
                _new_topic(
                    name, role, count, replication_factor, settings, brokers, configs, leaders
                )
                for name, (role, count) in wanted.items()
            ]
            response = await admin.create_topics(new)
            created = _check_created(response.topic_errors)
            described = await _until_led(admin, list(wanted))
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


async def delete_model_topics(
    settings: ClientSettings, model: str, lanes: Sequence[str] = ()
) -> None:
    """Delete ``model``'s topics (those of ``lanes``, and its shadow results topic, too);
    topics already gone are no error."""
    topics = topics_for(model, settings.topic_prefix)
    names = [
        topics.requests,
        *(topics.lane(lane) for lane in lanes),
        topics.results,
        topics.dlq,
        topics.shadow_results,
    ]
    admin = _admin(settings)
    try:
        async with asyncio.timeout(settings.connect_timeout_s * 3):
            await admin.start()
            response = await admin.delete_topics(names)
    except (KafkaError, OSError, TimeoutError) as exc:
        raise _unavailable(settings, str(exc) or "no answer in time") from None
    finally:
        await admin.close()
    for name, code, *_rest in response.topic_error_codes:
        if code not in (0, _UNKNOWN_TOPIC):
            raise ClientError(f"Kafka refused to delete topic {name} (error {code})")


def _new_topic(
    name: str,
    role: Role,
    partitions: int,
    replication_factor: int,
    settings: ClientSettings,
    brokers: Sequence[int],
    configs: Mapping[Role, Mapping[str, str]] | None,
    leaders: Mapping[Role, int] | None,
) -> NewTopic:
    config = {MAX_MESSAGE_BYTES: str(settings.limits.max_record_bytes)}
    config |= (configs or {}).get(role, {})
    leader = (leaders or {}).get(role)
    if leader is None:
        return NewTopic(name, partitions, replication_factor, topic_configs=config)
    if leader not in brokers:
        raise InvalidInput(f"broker {leader} should lead {name}, but the brokers are {brokers}")
    replicas = [leader, *(b for b in sorted(brokers) if b != leader)][:replication_factor]
    assignment = dict.fromkeys(range(partitions), replicas)
    return NewTopic(name, -1, -1, replica_assignments=assignment, topic_configs=config)


async def _broker_ids(admin: AIOKafkaAdminClient) -> list[int]:
    cluster = await admin.describe_cluster()
    return [int(broker["node_id"]) for broker in cluster["brokers"]]


async def _until_led(admin: AIOKafkaAdminClient, names: list[str]) -> list[dict[str, Any]]:
    """``describe_topics`` of ``names`` once every partition has a leader (the caller's
    timeout bounds the wait)."""
    while True:
        described: list[dict[str, Any]] = await admin.describe_topics(names)
        if all(_led(topic) for topic in described):
            return described
        await asyncio.sleep(_LEADER_POLL_S)


def _led(topic: dict[str, Any]) -> bool:
    partitions = topic["partitions"]
    return bool(partitions) and all(p["error_code"] == 0 and p["leader"] >= 0 for p in partitions)


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
