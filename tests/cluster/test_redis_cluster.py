"""Results on a Redis Cluster: the slot-grouped store, sharded waits, and primaries that fail.

The store and the reader are checked against the local 3-primary cluster with
redis-py's own cluster client as the independent witness. Then whole workers
and SDK callers run through a manual failover and through a primary killed
mid-run: results stay first-final-wins, nothing is lost, and every waiting
caller gets the answer that Redis holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from producers.client import AsyncClient
from producers.cluster_results import ClusterResultReader
from producers.errors import ResultTimeout
from producers.settings import ClientSettings
from producers.testing import Fleet, plain_url, read_results, until, until_answered
from schemas import Result, encode_result, ok_result, result_key
from tests.cluster.conftest import KafkaCluster, RedisClusterNodes
from tests.harness import check, setup_model, submit_paced, tally_scenario
from workers.config.worker import WorkerSettings
from workers.publish.cluster_store import (
    CLUSTER_WRITE_FIRST_SCRIPT,
    RedisClusterResultStore,
    open_result_store,
)
from workers.publish.result_store import WRITE_FIRST_SCRIPT


def _document(request_id: str, worker: str) -> bytes:
    return encode_result(ok_result(request_id, [1], model="m", model_version="1", worker=worker))


@pytest.fixture
async def store(healthy_redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisClusterResultStore]:
    settings = WorkerSettings(
        model="digits",
        redis_url=SecretStr(plain_url(healthy_redis_cluster.url)),
        redis_cluster=True,
        redis_replica_acks=1,
        result_ttl_s=600,
    )
    opened = open_result_store(settings)
    assert isinstance(opened, RedisClusterResultStore)
    yield opened
    await opened.aclose()


@pytest.fixture
async def witness(healthy_redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    """redis-py's own cluster client: reads what the store wrote, independently."""
    client = RedisCluster.from_url(plain_url(healthy_redis_cluster.url))
    await client.initialize()
    yield client
    await client.aclose()


def test_the_cluster_script_differs_only_in_its_wake_up() -> None:
    assert CLUSTER_WRITE_FIRST_SCRIPT.replace("SPUBLISH", "PUBLISH") == WRITE_FIRST_SCRIPT


def _primary(witness: RedisCluster, key: str) -> str:
    node = witness.get_node_from_key(key)
    assert node is not None, key
    return node.name


async def test_store_writes_a_batch_over_every_primary_first_write_wins(
    store: RedisClusterResultStore, witness: RedisCluster, uid: str
) -> None:
    ids = [f"{uid}-{n}" for n in range(64)]
    primaries = {_primary(witness, result_key(i)) for i in ids}
    assert len(primaries) == 3, "the batch must span every primary"
    first = [_document(i, "first") for i in ids]

    assert await store.write_first(ids, first) == [None] * len(ids)
    assert await witness.mget_nonatomic([result_key(i) for i in ids]) == first
    ttl = await witness.ttl(result_key(ids[0]))
    assert 590 < ttl <= 600

    # A redelivery answers again: every key keeps its first document, which comes back.
    half = ids[::2]
    again = await store.write_first(half, [_document(i, "second") for i in half])
    assert again == first[::2]
    assert await witness.mget_nonatomic([result_key(i) for i in ids]) == first
    # The same bytes again (a retried batch that had partly run) count as this call's.
    assert await store.write_first(half, first[::2]) == [None] * len(half)


async def test_store_reloads_its_script_on_every_node(
    store: RedisClusterResultStore, healthy_redis_cluster: RedisClusterNodes, uid: str
) -> None:
    await store.write_first([f"{uid}-warm"], [_document(f"{uid}-warm", "w")])
    for node in healthy_redis_cluster.nodes:  # script caches empty, as after restarts
        client = aioredis.Redis(port=healthy_redis_cluster.port + node - 1)
        await client.script_flush()
        await client.aclose()
    ids = [f"{uid}-{n}" for n in range(30)]
    assert await store.write_first(ids, [_document(i, "w") for i in ids]) == [None] * len(ids)
    assert await store.ping()


async def test_wait_many_over_every_primary_and_get(
    store: RedisClusterResultStore, cluster_settings: ClientSettings, uid: str
) -> None:
    ids = [f"{uid}-{n}" for n in range(90)]
    reader = ClusterResultReader(cluster_settings)
    try:
        early = ids[:30]  # answered before the wait starts: found by its first read
        await store.write_first(early, [_document(i, "w") for i in early])
        waited: list[Result] = []

        async def wait() -> None:
            async for result in reader.wait_many(ids, timeout=30):
                waited.append(result)

        waiting = asyncio.create_task(wait())
        for start in range(30, 90, 15):  # the rest arrive while it waits
            chunk = ids[start : start + 15]
            await store.write_first(chunk, [_document(i, "w") for i in chunk])
            await asyncio.sleep(0.05)  # spread the arrivals over time
        await asyncio.wait_for(waiting, 30)
        assert sorted(r.id for r in waited) == sorted(ids)
        got = await reader.get(ids[-1])
        assert got is not None
        assert got.worker == "w"
        assert await reader.get(f"{uid}-never") is None
        with pytest.raises(ResultTimeout) as timed_out:
            async for _ in reader.wait_many([ids[0], f"{uid}-never"], timeout=0.5):
                pass
        assert list(timed_out.value.request_ids) == [f"{uid}-never"]
    finally:
        await reader.close()


async def test_waits_and_writes_follow_a_manual_failover(
    store: RedisClusterResultStore,
    cluster_settings: ClientSettings,
    healthy_redis_cluster: RedisClusterNodes,
    uid: str,
) -> None:
    ids = [f"{uid}-{n}" for n in range(60)]
    seed = aioredis.Redis(port=healthy_redis_cluster.port)
    primary, replica_port = await _shard_of(seed, result_key(ids[0]))
    replica = aioredis.Redis(port=replica_port)
    reader = ClusterResultReader(cluster_settings)
    try:
        waited: list[Result] = []

        async def wait() -> None:
            async for result in reader.wait_many(ids, timeout=60):
                waited.append(result)

        waiting = asyncio.create_task(wait())
        await until_subscribed(result_key(ids[0]), primary)
        # The replica takes over its primary's slots: the old primary, a replica now,
        # drops its shard subscriptions and answers MOVED to the writes routed to it.
        await replica.cluster("FAILOVER")

        async def promoted() -> bool:
            return (await _shard_of(seed, result_key(ids[0])))[0] == replica_port

        await until(promoted, "the replica serves its primary's slots", 60)
        for start in range(0, 60, 20):
            chunk = ids[start : start + 20]
            written = await store.write_first(chunk, [_document(i, "w") for i in chunk])
            assert written == [None] * len(chunk)
        await asyncio.wait_for(waiting, 60)
        assert sorted(r.id for r in waited) == sorted(ids)
    finally:
        await reader.close()
        await replica.aclose()
        await seed.aclose()


async def _shard_of(any_node: aioredis.Redis, key: str) -> list[int]:
    """Ports of the shard serving ``key``: its primary first, then its replicas."""
    slot = key_slot(key.encode())
    for first, last, *nodes in await any_node.cluster("SLOTS"):
        if first <= slot <= last:
            return [int(node[1]) for node in nodes]
    raise AssertionError(f"slot {slot} is served by no node")


async def until_subscribed(channel: str, port: int) -> None:
    """Wait until ``port``'s node counts a sharded subscriber on ``channel``."""
    node = aioredis.Redis(port=port)
    try:

        async def subscribed() -> bool:
            # The raw reply ([channel, count]); redis-py leaves execute_command untyped.
            reply = await node.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
            return bool(reply[1])

        await until(subscribed, f"a sharded subscriber on {channel} at {port}", 30)
    finally:
        await node.aclose()


@pytest.mark.timeout(300)
async def test_primary_killed_mid_run_replica_promoted(
    healthy_kafka: KafkaCluster,
    healthy_redis_cluster: RedisClusterNodes,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    model_name: str,
) -> None:
    nodes, bootstrap = healthy_redis_cluster, healthy_kafka.bootstrap
    records, ids = await setup_model(bootstrap, model_name, digits, 3000, replication_factor=3)
    # A batch counts as written once a replica holds it too: the promoted replica has it all.
    cluster_workers.start("--max-batch-size", "8", "--redis-replica-acks", "1", redis_url=nodes.url)
    settings = ClientSettings(
        kafka_bootstrap=bootstrap,
        redis_url=SecretStr(plain_url(nodes.url)),
        redis_cluster=True,
        connect_timeout_s=30,  # longer than a failover: waits follow it instead of failing
    )
    seen: dict[str, Result] = {}

    async def wait(client: AsyncClient, chunk: list[str]) -> None:
        async for result in client.wait_many(chunk, timeout=240):
            seen[result.id] = result

    seed = aioredis.Redis(port=nodes.port + 1)
    async with AsyncClient(settings) as client:
        waiting = [asyncio.create_task(wait(client, ids[i : i + 500])) for i in range(0, 3000, 500)]
        stream = asyncio.create_task(submit_paced(bootstrap, model_name, records, 100, 0.1))
        await until_answered(nodes.url, ids, 400)
        victim_port = (await _shard_of(seed, result_key(ids[-1])))[0]
        victim = nodes.node_of_port(victim_port)
        if victim == 2:  # keep asking a node that stays up
            await seed.aclose()
            seed = aioredis.Redis(port=nodes.port + 2)
        nodes.kill(victim)

        async def failed_over() -> bool:
            return (await _shard_of(seed, result_key(ids[-1])))[0] != victim_port

        await until(failed_over, "a replica serves the killed primary's slots", 120)
        # The killed primary comes back as a replica of the promoted one (as a restarted
        # pod would): until then its shard has no replica to acknowledge writes.
        await asyncio.to_thread(nodes.start, victim)
        await stream
        await asyncio.wait_for(asyncio.gather(*waiting), 240)
    await seed.aclose()

    row = await tally_scenario(
        "Redis Cluster: a primary killed, replica promoted",
        bootstrap,
        nodes.url,
        model_name,
        ids,
        timeout_s=180,
    )
    check(row, cluster_workers.logs())
    assert "redis failed" in cluster_workers.logs()  # the failover really hit the worker
    # Every waiting caller got its answer, and it is the one Redis keeps.
    assert seen.keys() == set(ids)
    stored = await read_results(nodes.url, ids)
    assert all(seen[i] == stored[i] for i in ids)
