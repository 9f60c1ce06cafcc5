"""At start-up: the model's topics exist, and what the worker must know about them.

A worker whose results or dead-letter topic is missing could only stall (with
automatic topic creation off, as it should be, every send waits for a topic
that never comes), so ``check_topics`` finds out first and says which topics
are missing and how to create them. It also reads each topic's partition count
and ``max.message.bytes``, the largest record batch the broker accepts there:
result documents and dead-letter copies are sized against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from common.security import kafka_options
from schemas import DEFAULT_LANE, ModelTopics
from workers.config.worker import WorkerSettings
from workers.types import ConfigError

__all__ = ["TopicFacts", "TopicProblem", "check_topics"]

_UNKNOWN_TOPIC = 3
_TOPIC_AUTHORIZATION_FAILED = 29
_MAX_MESSAGE_BYTES = "max.message.bytes"
_KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588  # the broker's message.max.bytes default
_TIMEOUT_MS = 10_000


class TopicProblem(ConfigError):
    """The model's topics are missing or not ours to use: a configuration error that
    retrying does not fix. The message names the topics and what to do."""


@dataclass(frozen=True)
class TopicFacts:
    """Partitions and the largest accepted record batch (bytes), per topic."""

    partitions: dict[str, int]
    max_message_bytes: dict[str, int]


async def check_topics(settings: WorkerSettings, topics: ModelTopics) -> TopicFacts:
    """Describe the request topics (one per priority lane), results and dead-letter
    topics of ``topics``, and the next model's request topic of a pipeline (``then``).

    Raises ``TopicProblem`` when any is missing or unauthorized, ``KafkaError`` or
    ``OSError`` when Kafka cannot be asked.
    """
    lanes = [topics.lane(lane.name) for lane in settings.request_lanes]
    names = [*lanes, topics.results, topics.dlq]
    stage = settings.next_stage
    if stage is not None:  # a pipeline's next model: this worker writes its requests
        names.append(stage.topic)
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=f"{settings.worker_id}-admin",
        request_timeout_ms=_TIMEOUT_MS,
        **kafka_options(settings),
    )
    await admin.start()
    try:
        described = await admin.describe_topics(names)
        partitions = _partitions(described, names, settings)
        configs = await admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, name, {_MAX_MESSAGE_BYTES: None})
                for name in names
            ]
        )
    finally:
        await admin.close()
    return TopicFacts(partitions, _max_message_bytes(configs))


def _partitions(
    described: Sequence[dict[str, object]], names: Sequence[str], settings: WorkerSettings
) -> dict[str, int]:
    missing, forbidden, counts = [], [], {}
    stage = settings.next_stage
    next_topic = None if stage is None else stage.topic
    problems = []
    for topic in described:
        name, code = str(topic["topic"]), topic["error_code"]
        if code == _UNKNOWN_TOPIC and name == next_topic and stage is not None:
            problems.append(
                f"the next model's request topic {name} does not exist on "
                f"{settings.kafka_bootstrap}; create it with `conveyor topics create --model "
                f"{stage.model}` (add --partitions N for N of its workers)"
            )
        elif code == _UNKNOWN_TOPIC:
            missing.append(name)
        elif code == _TOPIC_AUTHORIZATION_FAILED:
            forbidden.append(name)
        elif code != 0:
            raise KafkaError(f"describing topic {name} failed with Kafka error {code}")
        else:
            counts[name] = len(topic["partitions"])  # type: ignore[arg-type]
    if missing:
        problems.append(
            f"topics {', '.join(sorted(missing))} do not exist on {settings.kafka_bootstrap}; "
            f"create them with `conveyor topics create --model {settings.served_name}"
            f"{_lanes_flag(settings)}` (add --partitions N for N workers)"
        )
    if forbidden:
        problems.append(
            f"this worker's Kafka principal may not describe topics "
            f"{', '.join(sorted(forbidden))}: grant it {_acls_for(forbidden, names, settings)} "
            "(each includes DESCRIBE; docs/security.md)"
        )
    if problems:
        raise TopicProblem("; ".join(problems))
    return {name: counts[name] for name in names}


def _acls_for(forbidden: Sequence[str], names: Sequence[str], settings: WorkerSettings) -> str:
    """The ACLs a worker needs on ``forbidden`` topics: READ on its request topics, WRITE
    on the results and dead-letter topics and on a next model's request topic."""
    requests = {name for name in names if name.startswith(settings.topics.requests)}
    return ", ".join(
        f"{'READ' if name in requests else 'WRITE'} on topic {name}" for name in sorted(forbidden)
    )


def _lanes_flag(settings: WorkerSettings) -> str:
    names = [lane.name for lane in settings.lanes if lane.name != DEFAULT_LANE]
    shadow = " --shadow" if settings.shadow else ""
    return (f" --lanes {','.join(names)}" if names else "") + shadow


def _max_message_bytes(responses: Sequence[object]) -> dict[str, int]:
    limits: dict[str, int] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:  # type: ignore[attr-defined]
            for entry in resource["config_entries"]:
                if entry["config_names"] == _MAX_MESSAGE_BYTES:
                    limits[resource["resource_name"]] = int(entry["config_value"])
    return limits


def max_message_bytes(facts: TopicFacts, topic: str) -> int:
    """The topic's limit; Kafka's default when it could not be read (no DescribeConfigs ACL)."""
    return facts.max_message_bytes.get(topic, _KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
