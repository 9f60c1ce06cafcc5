"""Payloads by reference, cancellation and status on a Redis Cluster.

The cluster variants of the per-batch script (one call per hash slot), of the
payload store (one pipeline per primary) and of the SDK's upload, cancel and
status, checked against the local 3-primary cluster with redis-py's own cluster
client as the independent witness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from common.redis_cluster import ClusterRouter
from producers.claims import Uploader
from producers.cluster_results import ClusterResultReader
from producers.settings import ClientSettings
from producers.testing import plain_url
from schemas import (
    cancel_key,
    encode_result,
    ok_result,
    parse_dataref,
    redis_dataref,
    result_key,
    status_key,
)
from tests.cluster.conftest import RedisClusterNodes
from workers.intake.admission import CANCELLED, ClusterRequestState
from workers.intake.payload_stores import ClusterRedisPayloads

IDS = [f"cl-{n}" for n in range(40)]  # their {id} tags spread over every primary


@pytest.fixture
async def witness(healthy_redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(plain_url(healthy_redis_cluster.url))
    await client.initialize()
    yield client
    for request_id in IDS:
        for key in (cancel_key(request_id), status_key(request_id), result_key(request_id)):
            await client.delete(key)
        await client.delete(f"conveyor:data:{request_id}")
    await client.aclose()


@pytest.fixture
async def router(healthy_redis_cluster: RedisClusterNodes) -> AsyncIterator[ClusterRouter]:
    router = ClusterRouter(plain_url(healthy_redis_cluster.url), {"socket_timeout": 5})
    yield router
    await router.aclose()


async def test_the_batch_script_cancels_and_counts_per_slot(
    router: ClusterRouter, witness: RedisCluster
) -> None:
    assert len({key_slot(cancel_key(i).encode()) for i in IDS}) > 3
    cancelled = set(IDS[::3])
    for request_id in cancelled:
        await witness.set(cancel_key(request_id), b"1")
    state = ClusterRequestState(router, ["1", "1", "600", "worker-a"])
    first = await state.start(IDS)
    assert first == [CANCELLED if i in cancelled else 1 for i in IDS]
    again = await state.start(IDS)
    assert again == [CANCELLED if i in cancelled else 2 for i in IDS]
    running = await witness.hgetall(status_key(IDS[1]))
    assert running[b"attempt"] == b"2"
    assert running[b"worker"] == b"worker-a"
    assert 0 < await witness.ttl(status_key(IDS[1])) <= 600
    assert await witness.exists(status_key(IDS[0])) == 0  # cancelled: never started


async def test_payloads_uploaded_by_the_sdk_are_read_per_primary(
    router: ClusterRouter, witness: RedisCluster, cluster_settings: ClientSettings
) -> None:
    uploader = Uploader(cluster_settings)
    try:
        await uploader.store([(i, i.encode() * 100) for i in IDS[:20]])
    finally:
        await uploader.close()
    assert await witness.get(f"conveyor:data:{IDS[3]}") == IDS[3].encode() * 100
    refs = [parse_dataref(redis_dataref(f"conveyor:data:{i}")) for i in IDS[:25]]
    store = ClusterRedisPayloads(router)
    sizes = await store.sizes(refs)
    assert sizes == [len(i) * 100 for i in IDS[:20]] + [None] * 5
    read = await store.read(refs, max_bytes=10_000)
    assert read == [i.encode() * 100 for i in IDS[:20]] + [None] * 5


async def test_sdk_status_and_cancel_on_a_cluster(
    witness: RedisCluster, cluster_settings: ClientSettings
) -> None:
    reader = ClusterResultReader(cluster_settings)
    try:
        queued = await reader.cancel(IDS[5], ttl_s=60)
        assert queued.state == "queued"
        assert await witness.get(cancel_key(IDS[5])) == b"1"
        await witness.hset(status_key(IDS[6]), mapping={"attempt": 1, "worker": "w"})
        running = await reader.status(IDS[6])
        assert (running.state, running.attempt, running.worker) == ("running", 1, "w")
        result = ok_result(IDS[7], [1], model="m", model_version="1", worker="w")
        await witness.set(result_key(IDS[7]), encode_result(result))
        done = await reader.cancel(IDS[7], ttl_s=60)
        assert done.state == "done"
        assert done.result == result
    finally:
        await reader.close()
