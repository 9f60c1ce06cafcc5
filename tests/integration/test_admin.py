"""``producers.admin`` against the real broker: what the harness and the benches rely on."""

from __future__ import annotations

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from producers.admin import create_model_topics, delete_model_topics
from producers.errors import InvalidInput
from producers.settings import ClientSettings
from producers.testing import until
from schemas import topics_for


async def test_new_topics_are_led_configured_by_role_and_deleted(
    client_settings: ClientSettings, kafka_admin: AIOKafkaAdminClient, model_name: str
) -> None:
    topics = topics_for(model_name)
    names = [topics.requests, topics.results, topics.dlq]
    states = await create_model_topics(
        client_settings, model_name, 3, configs={"dlq": {"max.message.bytes": "65536"}}
    )

    # Every partition has a leader on return: a producer finds them all at once.
    for topic in await kafka_admin.describe_topics(names):
        assert [p["leader"] >= 0 for p in topic["partitions"]] == [True] * len(topic["partitions"])
    sizes = {state.name: state.max_message_bytes for state in states}
    assert sizes[topics.dlq] == 65536  # the dead-letter topic's own setting
    assert sizes[topics.requests] == sizes[topics.results] != 65536

    await delete_model_topics(client_settings, model_name)
    await delete_model_topics(client_settings, model_name)  # already gone: no error

    async def gone() -> bool:
        return not set(names) & set(await kafka_admin.list_topics())

    await until(gone, "the model's topics are deleted", 30)


async def test_a_leader_that_is_no_broker_is_refused(
    client_settings: ClientSettings, model_name: str
) -> None:
    with pytest.raises(InvalidInput, match="broker 99 should lead"):
        await create_model_topics(client_settings, model_name, 1, leaders={"results": 99})
