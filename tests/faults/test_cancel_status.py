"""Cancellation and status against a real worker, Kafka and Redis.

1,000 requests wait in their topic; 500 are cancelled with the SDK before any
worker runs; a worker with ``--cancellation --track-status`` then answers those
500 ``cancelled`` without running them (its metrics say the model saw 500) and
the others ``ok``. Status moves queued → running → done, and ``attempt`` counts
the starts that the status hash recorded.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from producers import AsyncClient, ClientSettings
from producers.testing import Fleet, produce, until, wait_for_results
from schemas import ErrorCode, Status, status_key, topics_for
from tests.faults import faulty
from tests.harness import metrics, setup_model


@pytest.mark.timeout(240)
async def test_cancelled_requests_never_reach_the_model_and_the_rest_are_ok(
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    client_settings: ClientSettings,
    model_name: str,
) -> None:
    records, ids = await setup_model(kafka_bootstrap, model_name, digits, 1000)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    cancelled = ids[::2]
    async with AsyncClient(client_settings) as client:
        states = {(await client.cancel(request_id)).state for request_id in cancelled}
    assert states == {"queued"}
    worker = workers.start("--cancellation", "--track-status")
    results = await wait_for_results(redis_url, ids, timeout_s=180)
    assert len(results) == 1000, workers.logs()[-3000:]
    for request_id in cancelled:
        result = results[request_id]
        assert result.status is Status.error
        assert result.error is not None
        assert result.error.code == ErrorCode.cancelled
        assert result.timings is not None
        assert result.timings.batch_size == 0  # never in a batch
    kept = [i for i in ids if i not in set(cancelled)]
    assert {results[i].status for i in kept} == {Status.ok}
    assert {results[i].attempt for i in kept} == {1}
    counted = await metrics(worker)
    assert counted["conveyor_cancelled_total"] == 500
    assert counted["conveyor_batch_size_sum"] == 500  # requests that reached the model
    async with AsyncClient(client_settings) as client:
        # Cancelling after the result exists changes nothing: the first result stays.
        late = await client.cancel(kept[0])
        assert late.state == "done"
        assert late.result == results[kept[0]]
        assert (await client.status(kept[0])).result == results[kept[0]]


@pytest.mark.timeout(180)
async def test_status_goes_queued_running_done_and_attempts_are_counted(
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    client_settings: ClientSettings,
    model_name: str,
) -> None:
    records, ids = await setup_model(kafka_bootstrap, model_name, digits, 3, partitions=1)
    # As if two workers had started the last request and died before answering it.
    await redis_client.hset(status_key(ids[2]), mapping={"attempt": 2, "worker": "gone"})
    async with AsyncClient(client_settings) as client:
        assert (await client.status(ids[0])).state == "queued"
        worker = workers.start(
            "--track-status",
            "--max-batch-size",
            "1",
            model=faulty.SPEC,
            env={"CONVEYOR_TEST_SLOW_MS": "1500"},  # each batch runs 1.5 s
        )
        await produce(kafka_bootstrap, topics_for(model_name).requests, records)

        async def running() -> bool:
            status = await client.status(ids[0])
            return status.state == "running"

        await until(running, "the first request running", 120, worker.log)
        status = await client.status(ids[0])
        assert status.attempt == 1
        assert status.worker is not None
        assert status.started_ms is not None
        results = await wait_for_results(redis_url, ids, timeout_s=60)
        assert [results[i].attempt for i in ids] == [1, 1, 3]
        done = await client.status(ids[2])
        assert done.state == "done"
        assert done.result == results[ids[2]]
        assert await redis_client.ttl(status_key(ids[0])) > 0
