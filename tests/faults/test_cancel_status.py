"""Cancellation and status against a real worker, Kafka and Redis.

1,000 requests wait in their topic; 500 are cancelled with the SDK before any
worker runs; a worker with ``--cancellation --track-status`` then answers those
500 ``cancelled`` without running them (its metrics say the model saw 500) and
the others ``ok``. Status moves queued → running → done, and ``attempt`` counts
the starts that the status hash recorded.

1,000 cancels race a slow model's backlog, each sent as the worker's answers come
near its request: every cancel that Redis confirmed before its batch started
(``batch_start_ms`` of the batch's results) is answered ``cancelled``, the others
ran, each id is answered once, and every request's status says running from the
moment its batch started, not before.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from producers import AsyncClient, ClientSettings
from producers.testing import Fleet, produce, until, wait_for_results
from schemas import ErrorCode, Result, Status, result_key, status_key, topics_for
from tests.faults import faulty
from tests.harness import NOTES, check, metrics, setup_model, tally_scenario


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


RACED = 2000  # requests in the backlog; every other one is cancelled
SLOW_MS = 40  # per batch of 8: about 200 requests a second


@pytest.mark.timeout(300)
async def test_cancels_racing_a_backlog_take_effect_until_their_batch_starts(
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    client_settings: ClientSettings,
    model_name: str,
) -> None:
    records, ids = await setup_model(kafka_bootstrap, model_name, digits, RACED, partitions=1)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker = workers.start(
        "--cancellation",
        "--track-status",
        "--max-batch-size",
        "8",
        model=faulty.SPEC,
        env={"CONVEYOR_TEST_SLOW_MS": str(SLOW_MS)},
    )
    confirmed: dict[str, float] = {}  # epoch ms when Redis had confirmed the cancel
    state_then: dict[str, str] = {}
    async with AsyncClient(client_settings) as client:
        for index in range(1, RACED, 2):
            # One partition is served in order: once the request `lead` places back has
            # an answer, this one is in the batch running, the next, or one after that.
            lead = 4 + index % 24
            if index >= lead:
                await _answered(redis_client, ids[index - lead], worker.log)
            status = await client.cancel(ids[index])
            confirmed[ids[index]] = time.time() * 1000.0
            state_then[ids[index]] = status.state
    results = await wait_for_results(redis_url, ids, timeout_s=120)
    assert len(results) == RACED, workers.logs()[-3000:]
    counted = await tally_scenario(
        "1,000 cancels racing a slow model's backlog", kafka_bootstrap, redis_url, model_name, ids
    )
    check(counted, workers.logs())
    assert counted.redelivered == 0  # no id answered twice on the reply topic either

    cancelled = [i for i in confirmed if _is_cancelled(results[i])]
    ran = [i for i in confirmed if i not in set(cancelled)]
    assert cancelled, "no cancel came before its batch: they did not race the batches"
    assert ran, "no cancel came after its batch started: they did not race the batches"
    for request_id in cancelled:
        timings = results[request_id].timings
        assert timings is not None
        assert timings.batch_size == 0  # never in a batch
        assert state_then[request_id] == "queued"
    early: dict[str, float] = {}  # ran, though confirmed this many ms before its batch start
    for request_id in ran:
        result = results[request_id]
        assert result.status is Status.ok, result
        assert result.timings is not None
        assert result.timings.batch_start_ms is not None
        if confirmed[request_id] < result.timings.batch_start_ms:
            early[request_id] = result.timings.batch_start_ms - confirmed[request_id]
        else:  # confirmed once the batch had started: too late, as documented
            assert state_then[request_id] in ("running", "done")
    assert not early, (
        f"{len(early)} of {len(confirmed)} requests ran although their cancel was confirmed "
        f"before their batch started (by up to {max(early.values()):.1f} ms): {early}"
    )
    kept = [i for i in ids if i not in confirmed]
    assert {results[i].status for i in kept} == {Status.ok}

    # Running from the moment the batch started (the status hash's started_ms), not before.
    pipe = redis_client.pipeline(transaction=False)
    for request_id in (*ran, *kept):
        pipe.hget(status_key(request_id), "started_ms")
    for request_id, started in zip((*ran, *kept), await pipe.execute(), strict=True):
        timings = results[request_id].timings
        assert timings is not None
        assert timings.batch_start_ms is not None
        assert math.floor(timings.batch_start_ms) <= int(started) <= timings.finished_ms

    near = _honoured_near_the_start(ids, results, confirmed)
    NOTES.append(
        f"1,000 cancels racing a slow model's backlog: {len(cancelled)} cancelled, "
        f"{len(ran)} ran (confirmed after their batch started); {near} cancelled though "
        f"confirmed less than {SLOW_MS} ms before the next request's batch started"
    )


async def _answered(redis: aioredis.Redis, request_id: str, logs: Callable[[], str]) -> None:
    """Wait until ``request_id`` has a result (polled often: the worker answers about
    one request every 5 ms)."""
    deadline = time.monotonic() + 120
    while not await redis.exists(result_key(request_id)):
        assert time.monotonic() < deadline, f"no answer for {request_id}\n{logs()[-3000:]}"
        await asyncio.sleep(0.002)  # polling interval, not a wait for readiness


def _is_cancelled(result: Result) -> bool:
    return result.error is not None and result.error.code == ErrorCode.cancelled


def _honoured_near_the_start(
    ids: list[str], results: dict[str, Result], confirmed: dict[str, float]
) -> int:
    """Cancelled requests whose cancel came less than a batch's time before the batch
    start of the request after them (which ran: its batch is theirs, or the next)."""
    near = 0
    for n, request_id in enumerate(ids[:-1]):
        if request_id not in confirmed or not _is_cancelled(results[request_id]):
            continue
        after = results[ids[n + 1]].timings
        if after is not None and after.batch_start_ms is not None:
            near += 0 <= after.batch_start_ms - confirmed[request_id] < SLOW_MS
    return near
