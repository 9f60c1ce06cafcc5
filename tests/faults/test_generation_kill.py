"""A generation worker SIGKILLed mid-generation: one final answer, and a stream that says
the request was generated again.

The reader follows the stream from before the first worker starts; at its third chunk
the worker is killed (nothing of its run ends), a second worker takes the partitions
over and generates the request again: its ``start`` (attempt 2, with status tracking)
comes after the first run's chunks, and ``client.stream`` flags it ``restarted``, so the
reader's text is the second run's alone, equal to the final answer (greedy: both runs
make the same tokens). Nothing is lost, no id is answered twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.admin import create_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import Fleet
from producers.token_stream import StreamEvent
from schemas import ContentType, Status
from tests.harness import check, tally_scenario

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEW_TOKENS = 400


@pytest.mark.timeout(480)
async def test_a_killed_generation_is_generated_again_and_its_stream_says_so(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    tiny_llm: Path,
) -> None:
    await create_model_topics(client_settings, model_name, partitions=2)
    flags = ("--track-status", "--model-options", json.dumps({"max_new_tokens": NEW_TOKENS}))
    async with AsyncClient(client_settings) as client:
        ids = [
            await client.submit(
                prompt.encode(),
                model=model_name,
                content_type=ContentType.TEXT,
                params={"max_new_tokens": NEW_TOKENS},
            )
            for prompt in ("Conveyor serves models", "Kafka in, Redis out", "first final wins")
        ]
        first = workers.start(*flags, model=f"hf:{tiny_llm}")
        events: list[StreamEvent] = []
        chunks = 0
        async for event in client.stream(ids[0], timeout=360):
            events.append(event)
            chunks += event.type == "chunk"
            if chunks == 3 and first.running():
                first.kill()  # mid-generation: this run never ends
                workers.start(*flags, model=f"hf:{tiny_llm}")
        result = await client.wait(ids[0], timeout=240)

    starts = [e for e in events if e.type == "start"]
    assert len(starts) == 2, events[:10]
    assert not starts[0].restarted
    assert starts[1].restarted
    assert starts[0].run != starts[1].run
    assert (starts[0].attempt, starts[1].attempt) == (1, 2)
    assert events[-1].type == "end"
    after = events[events.index(starts[1]) :]
    assert all(e.run == starts[1].run for e in after)
    assert result.status is Status.ok, result
    assert result.attempt == 2
    assert "".join(e.text for e in after if e.type == "chunk") == result.outputs["text"]
    tally = await tally_scenario(
        "generation: worker SIGKILL mid-generation, another",
        kafka_bootstrap,
        redis_url,
        model_name,
        ids,
    )
    check(tally, workers.logs())
    assert tally.answered == len(ids)
