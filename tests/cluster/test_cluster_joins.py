"""A pipeline's joins on the local Redis Cluster: parents spread over every primary, each
join in its result key's slot, children answered once each, a redelivery changing
nothing, empty script caches, and a parent answered at its deadline
(``workers.chain.joins`` through ``workers.chain.scripts.OnCluster``); then two real
workers, the demo detector and the digits classifier, on the Kafka and Redis clusters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from demo.models.detector import DigitsDetector
from demo.models.digits import DigitsClassifier
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, plain_url, produce, read_results, until, wait_for_results
from producers.testing.kafka import requests
from schemas import ContentType, Status, result_key, topics_for
from schemas.chain import child_id, join_key
from tests.cluster.conftest import KafkaCluster, RedisClusterNodes
from tests.integration.test_chain import DETECTOR, THEN, check_answer, scene_pngs
from tests.integration.test_chain_joins import FIRST, _child, _once, _parent, _settled
from workers.chain.joins import Joins
from workers.chain.scripts import OnCluster
from workers.config.next_stage import NextStage
from workers.config.worker import WorkerSettings
from workers.model.runner import ModelRunner
from workers.types import Outbox

PARENTS = 40


def _joins(url: str, *, then: bool, written: list[Outbox] | None = None) -> Joins:
    """A worker's joins as the worker opens them, from its settings."""
    chained: dict[str, Any] = {"then": "next", "then_options": {"min_score": 0.3}}
    settings = WorkerSettings(
        model="first" if then else "next",
        redis_url=SecretStr(plain_url(url)),
        redis_cluster=True,
        result_ttl_s=60,
        **(chained if then else {}),
    )

    async def publish(outbox: Outbox) -> None:
        assert written is not None
        written.append(outbox)

    return Joins.open(
        settings,
        FIRST,
        _once,
        stage=NextStage.parse("next", {"min_score": 0.3, "margin": 0.0}, "conveyor")
        if then
        else None,
        next_partitions=3,
        max_crop_bytes=10**6,
        max_result_bytes=10**6,
        results_topic="conveyor.first.results",
        publish=publish if written is not None else None,
    )


@pytest.fixture
async def witness(healthy_redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    """redis-py's own cluster client: reads what the joins wrote, independently."""
    client = RedisCluster.from_url(plain_url(healthy_redis_cluster.url))
    await client.initialize()
    yield client
    await client.aclose()


async def test_parents_over_every_primary_each_answered_once_with_its_children(
    healthy_redis_cluster: RedisClusterNodes, witness: RedisCluster, uid: str
) -> None:
    first = _joins(healthy_redis_cluster.url, then=True)
    second = _joins(healthy_redis_cluster.url, then=False)
    assert isinstance(first._scripts, OnCluster)
    parents = [f"p-{uid}-{n}" for n in range(PARENTS)]
    primaries = {witness.get_node_from_key(result_key(p)).name for p in parents}  # type: ignore[union-attr]
    assert len(primaries) == 3, "the parents must span every primary"
    try:
        sent = await _settled(first, parents=[_parent(p, 0.9, 0.5) for p in parents])
        assert sent.ids == []
        assert len(sent.requests) == 2 * PARENTS
        for parent in parents:  # each join beside its result key, and whole
            key = join_key(parent, cluster=True)
            assert key_slot(key.encode()) == key_slot(result_key(parent).encode())
            assert await witness.hget(key, "count") == b"2"

        # Every child's answer in one publish (two per join), the second labels first.
        children = [_child(p, i, 2, str(3 + i)) for i in (1, 0) for p in parents]
        done = await _settled(second, children=children)
        assert sorted(done.ids) == sorted(parents)
        for parent, value in zip(done.ids, done.values, strict=True):
            found = orjson.loads(value)["outputs"]["detections"]
            assert [d["next"]["outputs"][0]["label"] for d in found] == ["3", "4"], parent

        # A redelivered answer changes nothing: the same documents come back.
        again = await _settled(second, children=[_child(p, 0, 2, "9") for p in parents])
        assert dict(zip(again.ids, again.values, strict=True)) == dict(
            zip(done.ids, done.values, strict=True)
        )
    finally:
        await first.aclose()
        await second.aclose()


async def test_empty_script_caches_are_filled_again(
    healthy_redis_cluster: RedisClusterNodes, uid: str
) -> None:
    first = _joins(healthy_redis_cluster.url, then=True)
    try:
        await _settled(first, parents=[_parent(f"w-{uid}", 0.9)])
        for node in healthy_redis_cluster.nodes:  # as after restarts
            client = aioredis.Redis(port=healthy_redis_cluster.port + node - 1)
            await client.script_flush()
            await client.aclose()
        parents = [f"p-{uid}-{n}" for n in range(PARENTS)]
        sent = await _settled(first, parents=[_parent(p, 0.9) for p in parents])
        assert len(sent.requests) == PARENTS
    finally:
        await first.aclose()


async def test_a_parent_is_answered_at_its_deadline(
    healthy_redis_cluster: RedisClusterNodes, uid: str
) -> None:
    written: list[Outbox] = []
    first = _joins(healthy_redis_cluster.url, then=True, written=written)
    parent = f"p-{uid}"
    made = _parent(parent, 0.9, 0.8)
    made.item.meta = made.item.meta._replace(deadline=datetime.now(UTC) + timedelta(seconds=1))
    try:
        await _settled(first, parents=[made])
        await _settled(first, children=[_child(parent, 1, 2, "5")])
        await until(lambda: bool(written), "the result written at the deadline", 10)
        (outbox,) = written
        assert outbox.ids == [parent]
        first_box, second_box = orjson.loads(outbox.values[0])["outputs"]["detections"]
        assert first_box["next"]["status"] == "expired"
        assert second_box["next"]["outputs"][0]["label"] == "5"
    finally:
        await first.aclose()


@pytest.mark.timeout(300)
async def test_a_pipeline_of_two_workers_answers_every_box_on_the_redis_cluster(
    healthy_kafka: KafkaCluster,
    healthy_redis_cluster: RedisClusterNodes,
    cluster_workers: Fleet,
    detector: Path,
    digits: Any,
    model_name: str,
) -> None:
    """The demo detector, then the digits classifier on each box, both on the Redis
    Cluster: one answer per request, each box classified as the two models run directly
    would, and no box answered under its own id."""
    bootstrap, url = healthy_kafka.bootstrap, healthy_redis_cluster.url
    classifier = f"{model_name}c"
    settings = ClientSettings(kafka_bootstrap=bootstrap)
    for model in (model_name, classifier):
        await create_model_topics(settings, model, partitions=3, replication_factor=3)
    scenes = scene_pngs(30, seed=5)
    records, ids = requests(scenes, 150, model_name, ContentType.PNG)
    cluster_workers.start("--model-name", classifier, model="digits", redis_url=url)
    cluster_workers.start(
        "--then", classifier, "--then-options", THEN, model=DETECTOR, redis_url=url
    )
    await produce(bootstrap, topics_for(model_name).requests, records)

    results = await wait_for_results(url, ids, timeout_s=180)
    assert set(results) == set(ids), cluster_workers.logs()
    direct = (
        ModelRunner(DigitsDetector(device="cpu"), device="cpu"),
        ModelRunner(DigitsClassifier(device="cpu"), device="cpu"),
    )
    boxes = 0
    for n, request_id in enumerate(ids):
        assert results[request_id].status is Status.ok, results[request_id]
        boxes += check_answer(
            request_id, scenes[n % len(scenes)], results[request_id].outputs, direct
        )
    assert boxes >= len(ids)
    children = [child_id(i, 0) for i in ids[:50]]
    assert await read_results(url, children) == {}  # no box answered on its own
