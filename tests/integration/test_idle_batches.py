"""A lone request on an idle worker is answered without waiting for ``max_delay``: the
worker's consumer has caught up with every partition, so its batch closes at once."""

from __future__ import annotations

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, until_all_ready, wait_for_results
from schemas import ContentType, Status, encode_request, topics_for

_MAX_DELAY_MS = 60_000  # the most the setting takes; each answer is awaited 20 s at most


@pytest.mark.timeout(55)  # below max_delay: a batch that waited for it fails the test
async def test_a_lone_request_on_an_idle_worker_does_not_wait_for_max_delay(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    worker = workers.start("--max-delay-ms", str(_MAX_DELAY_MS))
    await until_all_ready([worker], timeout_s=30, settle_s=1.0)

    for n, (png, _digit) in enumerate(digits[:2]):  # one after the other, each alone
        request_id = f"{model_name}-lone-{n}"
        lone = encode_request(
            png, request_id=request_id, content_type=ContentType.PNG, source="tests"
        )
        await produce(kafka_bootstrap, topics.requests, [lone])
        result = (await wait_for_results(redis_url, [request_id], timeout_s=20))[request_id]
        assert result.status is Status.ok, workers.logs()
        assert result.timings is not None
        assert result.timings.batch_size == 1
        # The result's own timings: it waited in the worker far less than max_delay.
        assert result.timings.queue_ms < _MAX_DELAY_MS / 2
