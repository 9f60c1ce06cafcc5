"""Priority lanes decide which waiting request joins a generation engine next.

One worker, an engine of one place (``max_sequences`` 1), lanes ``high:8`` and the plain
request topic. Six plain requests and one high-lane request wait in their topics before
the worker starts; the high one joins the engine at most one plain request after the
first (the lanes' weights pick it as soon as both lanes have a request waiting), where
a single lane would have taken it last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.admin import create_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import Fleet
from schemas import ContentType, Status

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(300)
async def test_the_high_lane_joins_the_engine_before_the_waiting_plain_requests(
    client_settings: ClientSettings, model_name: str, workers: Fleet, tiny_llm: Path
) -> None:
    await create_model_topics(client_settings, model_name, partitions=1, lanes=["high"])
    params = {"max_new_tokens": 6}
    async with AsyncClient(client_settings) as client:
        plain = [
            await client.submit(
                f"plain {n}".encode(),
                model=model_name,
                content_type=ContentType.TEXT,
                params=params,
            )
            for n in range(6)
        ]
        high = await client.submit(
            b"urgent", model=model_name, content_type=ContentType.TEXT, params=params, lane="high"
        )
        options = json.dumps({"max_sequences": 1})
        workers.start("--lanes", "high:8", "--model-options", options, model=f"hf:{tiny_llm}")
        results = {i: await client.wait(i, timeout=240) for i in [*plain, high]}
    assert {r.status for r in results.values()} == {Status.ok}
    joined: dict[str, float] = {}
    for request_id, result in results.items():
        assert result.timings is not None
        assert result.timings.batch_start_ms is not None  # when it joined the engine
        joined[request_id] = result.timings.batch_start_ms
    order = sorted(joined, key=joined.__getitem__)
    assert order.index(high) <= 1, order
