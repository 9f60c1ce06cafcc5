"""The fault tests' paced stream (``tests.harness.submit_paced``) on the real broker: fed
``endless_digit_requests``, it runs until its ``stop`` is set, however long the fault
it carries through takes (tests/cluster/test_kafka_failover.py's rolling restart of
every broker), and returns exactly the ids on the topic, the first ones those of
``digit_requests``."""

from __future__ import annotations

import asyncio

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import read_topic, until
from schemas import topics_for
from tests.harness import digit_requests, endless_digit_requests, submit_paced

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
async def test_an_endless_paced_stream_runs_until_stopped_and_returns_every_id_sent(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=3)
    topic = topics_for(model_name).requests
    done = asyncio.Event()
    endless = endless_digit_requests(digits, model_name)
    stream = asyncio.create_task(
        submit_paced(kafka_bootstrap, model_name, endless, chunk=20, pause_s=0.05, stop=done)
    )
    arrived: list[str] = []

    async def past_a_bounded_streams_length() -> bool:
        assert not stream.done(), "the stream ended before it was stopped"
        arrived[:] = [r.key.decode() for r in await read_topic(kafka_bootstrap, topic, 1, 5)]
        return len(arrived) >= 400  # 20 chunks: as long as the restarts take, not a count

    await until(past_a_bounded_streams_length, "400 requests on the topic", 90)
    done.set()
    sent = await stream
    assert len(sent) == len(set(sent)) >= 400
    _, bounded = digit_requests(digits, 200, prefix=model_name)
    assert sent[:200] == bounded  # the ids a test waits on before its faults
    on_topic = [r.key.decode() for r in await read_topic(kafka_bootstrap, topic, len(sent), 30)]
    assert sorted(on_topic) == sorted(sent)  # exactly what it says it sent: the loss check's ids
