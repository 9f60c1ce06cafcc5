"""Generation on a Redis Cluster: the streams of requests whose ids hash to different
primaries, read by the SDK, join to their final texts; a cancel stops a generation early
(the worker looks for cancel keys on each primary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr
from transformers import AutoTokenizer

from common.redis_cluster import ClusterRouter
from producers.admin import create_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import Fleet, plain_url
from producers.token_stream import StreamEvent
from schemas import ContentType, Status, stream_key
from tests.cluster.conftest import KafkaCluster, RedisClusterNodes
from tests.generation_model import cancel_mid_stream, greedy_reference

PROMPTS = ["Conveyor serves models from Kafka", "A worker commits offsets", "first final wins"]
NEW_TOKENS = 12
LONG = 400


def _text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.type == "chunk")


async def _one_per_primary(url: str, prefix: str) -> list[str]:
    """Request ids whose streams live on different primaries, one per prompt."""
    router = ClusterRouter(plain_url(url), {"socket_timeout": 5})
    ids = {
        stream_key(request_id): request_id for request_id in (f"{prefix}-{n}" for n in range(64))
    }
    try:
        plan = await router.by_node(ids)
    finally:
        await router.aclose()
    assert len(plan) >= len(PROMPTS), plan  # the project's cluster has three primaries
    return [ids[next(iter(slots.values()))[0]] for slots in plan.values()][: len(PROMPTS)]


@pytest.mark.timeout(420)
async def test_streams_and_cancels_work_on_the_redis_cluster(
    healthy_kafka: KafkaCluster,
    healthy_redis_cluster: RedisClusterNodes,
    cluster_workers: Fleet,
    tiny_llm: Path,
    model_name: str,
) -> None:
    bootstrap, url = healthy_kafka.bootstrap, healthy_redis_cluster.url
    settings = ClientSettings(
        kafka_bootstrap=bootstrap,
        redis_url=SecretStr(plain_url(url)),
        redis_cluster=True,
        connect_timeout_s=15,
    )
    await create_model_topics(settings, model_name, partitions=2, replication_factor=3)
    options = json.dumps({"max_new_tokens": 450, "default_new_tokens": NEW_TOKENS})
    worker = cluster_workers.start(
        "--cancellation", "--model-options", options, model=f"hf:{tiny_llm}", redis_url=url
    )
    await worker.until_ready(300)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llm)
    ids = await _one_per_primary(url, model_name)
    async with AsyncClient(settings) as client:
        for request_id, prompt in zip(ids, PROMPTS, strict=True):
            await client.submit(
                prompt.encode(), model=model_name, content_type=ContentType.TEXT,
                params={"temperature": 0, "token_ids": True}, request_id=request_id,
            )  # fmt: skip
        for request_id, prompt in zip(ids, PROMPTS, strict=True):
            events = [event async for event in client.stream(request_id, timeout=120)]
            result = await client.wait(request_id, timeout=120)
            assert result.status is Status.ok, (result, cluster_workers.logs())
            reference = greedy_reference(tiny_llm, tokenizer(prompt)["input_ids"], NEW_TOKENS)
            assert result.outputs["token_ids"] == reference
            assert [events[0].type, events[-1].type] == ["start", "end"]
            assert _text(events) == result.outputs["text"]

        long_id = await client.submit(
            PROMPTS[0].encode(),
            model=model_name,
            content_type=ContentType.TEXT,
            params={"max_new_tokens": LONG},
        )
        _, cancelled = await cancel_mid_stream(client, long_id)
        assert cancelled.error is not None
        made = int(cancelled.error.message.rsplit("after ", 1)[1].split()[0])
        assert 0 < made < LONG
