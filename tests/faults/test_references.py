"""Payloads by reference through real workers, Kafka, Redis and SeaweedFS's S3 gateway.

- the SDK stores payloads above its threshold in Redis or S3 and the worker serves
  them; an object that is missing gets ``dataref_missing``;
- a 50 MB image goes through a request topic whose ``max.message.bytes`` is 1 MB,
  with the worker's resident memory bounded by the fetch and decode budgets.

- a worker whose object store stops mid-run turns unready (``/readyz``:
  ``payload_stores`` fails, ``conveyor_dataref_store_down{store="s3"}`` is 1) while
  Redis and Kafka are fine, and ready again once the store is back; every request
  is answered ``ok``, none lost.

The object store stopped mid-run is also a row of the fault table (test_faults.py).
"""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import redis.asyncio as aioredis
from PIL import Image

from common.s3 import S3Settings, s3_client
from producers import AsyncClient, ClientSettings
from producers.admin import Role, create_model_topics
from producers.testing import (
    Fleet,
    WorkerProcess,
    count_results,
    http_get,
    produce,
    tally,
    until,
    until_answered,
    wait_for_results,
)
from schemas import ContentType, ErrorCode, Status, encode_request, redis_dataref, topics_for
from tests.faults import faulty
from tests.harness import LocalService, check, peak_rss_mb_while, rss_mb, s3_flags


def _png(side: int, seed: int = 0) -> bytes:
    """A noise PNG: it barely compresses, so its size is about side² × 3 bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


@pytest.mark.timeout(240)
async def test_the_sdk_sends_large_payloads_by_reference_through_redis_and_s3(
    workers: Fleet,
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    client_settings: ClientSettings,
    model_name: str,
    s3_options: dict[str, str],
    s3_bucket: str,
) -> None:
    """A 1 MB image goes by reference (Redis, then S3), a small one in the record; a
    referenced object deleted before the worker reads it gets dataref_missing."""
    await create_model_topics(client_settings, model_name, partitions=1)
    big, small = _png(600, seed=1), _png(8, seed=2)
    assert len(big) > 768 * 1024
    async with AsyncClient(client_settings) as client:
        via_redis = await client.submit_many([big, small], model=model_name)
    via_redis_record = await redis_client.get(f"conveyor:data:{via_redis[0]}")
    assert via_redis_record == big  # stored, with a TTL
    assert 0 < await redis_client.ttl(f"conveyor:data:{via_redis[0]}") <= 3600
    assert await redis_client.exists(f"conveyor:data:{via_redis[1]}") == 0  # sent inline
    s3_client_settings = ClientSettings.model_validate(
        {
            **client_settings.model_dump(),
            **s3_options,
            "dataref_store": "s3",
            "dataref_s3_bucket": s3_bucket,
        }
    )
    async with AsyncClient(s3_client_settings) as client:
        via_s3 = await client.submit(big, model=model_name)
    # A payload deleted before any worker reads it.
    gone = "gone-1"
    record = encode_request(
        b"",
        request_id=gone,
        content_type=ContentType.PNG,
        source="t",
        dataref=redis_dataref("conveyor:data:never-stored"),
    )
    await produce(kafka_bootstrap, topics_for(model_name).requests, [record])
    workers.start(*s3_flags(s3_options, s3_bucket))
    ids = [*via_redis, via_s3, gone]
    results = await wait_for_results(redis_url, ids, timeout_s=180)
    assert set(results) == set(ids), workers.logs()[-3000:]
    for request_id in (*via_redis, via_s3):
        assert results[request_id].status is Status.ok, results[request_id]
    error = results[gone].error
    assert error is not None
    assert error.code == ErrorCode.dataref_missing
    assert "redis:conveyor:data:never-stored" in error.message


OBJECT_SIDE = 4096  # a 4096x4096 RGB noise PNG: about 50 MB
BUDGET_MB = 64
RSS_SLACK_MB = 150  # allocator and interpreter growth beside the payloads and decodes


@pytest.mark.timeout(300)
async def test_a_50_mb_image_through_a_1_mb_topic_with_bounded_memory(
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    client_settings: ClientSettings,
    redis_url: str,
    model_name: str,
    s3_options: dict[str, str],
    s3_bucket: str,
) -> None:
    """Three 50 MB images by reference (S3) through a request topic that takes 1 MB
    records: all served; the worker's resident memory grows by less than the fetch
    budget, one S3 body being joined, the decode budget and slack."""
    configs: dict[Role, dict[str, str]] = {"requests": {"max.message.bytes": "1048588"}}
    await create_model_topics(client_settings, model_name, 1, configs=configs)
    image = _png(OBJECT_SIDE, seed=3)
    object_mb = len(image) / 2**20
    assert object_mb > 48
    settings = ClientSettings.model_validate(
        {
            **client_settings.model_dump(),
            **s3_options,
            "dataref_store": "s3",
            "dataref_s3_bucket": s3_bucket,
        }
    )
    worker = workers.start(
        "--decode-memory-mb",
        str(BUDGET_MB),
        "--decode-threads",
        "4",
        *s3_flags(s3_options, s3_bucket),
    )
    async with AsyncClient(settings) as client:
        warm = await client.submit(digits[0][0], model=model_name)  # small: in the record
        assert (await client.wait(warm, timeout=120)).status is Status.ok
        baseline = rss_mb(worker.pid)
        ids = await client.submit_many([image] * 3, model=model_name)
        work = wait_for_results(redis_url, ids, timeout_s=240)
        peak, results = await peak_rss_mb_while(worker, work)
    assert {results[i].status for i in ids} == {Status.ok}, workers.logs()[-3000:]
    bound = 2 * BUDGET_MB + object_mb + RSS_SLACK_MB
    assert peak - baseline < bound, f"RSS grew {peak - baseline:.0f} MB (bound {bound:.0f})"
    print(f"50 MB images: RSS grew {peak - baseline:.0f} MB of a {bound:.0f} MB bound")


async def _readiness(worker: WorkerProcess) -> tuple[int, dict[str, str]]:
    """The worker's /readyz now: its status and its checks (empty before it listens)."""
    port = worker.metrics_port()
    if port is None:
        return 0, {}
    status, body = await http_get(port, "/readyz")
    return status, json.loads(body)["checks"]


async def _s3_down_gauge(worker: WorkerProcess) -> float | None:
    port = worker.metrics_port()
    assert port is not None
    _, body = await http_get(port, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith("conveyor_dataref_store_down{") and 'store="s3"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(300)
async def test_a_worker_is_unready_while_its_object_store_is_down(
    private_s3: LocalService,  # first: it stops after the workers
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    s3_options: dict[str, str],
) -> None:
    options = s3_options | {"s3_endpoint_url": f"http://127.0.0.1:{private_s3.port}"}
    bucket = "payloads"
    async with s3_client(S3Settings.model_validate(options)) as s3:
        await s3.create_bucket(Bucket=bucket)
    await create_model_topics(client_settings, model_name, partitions=1)
    settings = ClientSettings.model_validate(
        {
            **client_settings.model_dump(),
            **options,
            "dataref_store": "s3",
            "dataref_s3_bucket": bucket,
            "dataref_threshold_bytes": 1,  # every payload by reference
        }
    )
    payloads = [digits[n % len(digits)][0] for n in range(1000)]
    async with AsyncClient(settings) as client:
        ids = await client.submit_many(payloads, model=model_name)
    worker = workers.start(
        "--max-batch-size",
        "8",
        "--unready-after-s",
        "1",
        *s3_flags(options, bucket),
        model=faulty.SPEC,
        env={"CONVEYOR_TEST_SLOW_MS": "50"},  # about 160 requests a second
    )

    async def readiness_is(status: int, stores: str) -> bool:
        answer, checks = await _readiness(worker)
        return answer == status and checks.get("payload_stores") == stores

    await until_answered(redis_url, ids, 80)
    await until(lambda: readiness_is(200, "ok"), "the worker ready", 60, worker.log, [worker])
    await asyncio.to_thread(private_s3.stop)
    await until(
        lambda: readiness_is(503, "failed"),
        "/readyz failing on payload_stores while S3 is down",
        60,
        worker.log,
        [worker],
    )
    _, checks = await _readiness(worker)
    # Only the object store is down: results still become durable.
    assert {name: outcome for name, outcome in checks.items() if outcome != "ok"} == {
        "payload_stores": "failed"
    }
    assert await _s3_down_gauge(worker) == 1.0
    stalled = await count_results(redis_url, ids)
    assert stalled < len(ids)  # the outage held requests back
    await asyncio.to_thread(private_s3.start)
    await until(
        lambda: readiness_is(200, "ok"), "/readyz ok once S3 is back", 120, worker.log, [worker]
    )
    results = await wait_for_results(redis_url, ids, timeout_s=180)
    assert {r.status for r in results.values()} == {Status.ok}, workers.logs()[-3000:]
    # Every retry of the store ended in an answer: the gauge says so. (Read earlier, it may
    # still be 1 while a call begun during the outage fails after another succeeded.)
    assert await _s3_down_gauge(worker) == 0.0
    counted = await tally(kafka_bootstrap, redis_url, topics_for(model_name).results, ids)
    check(counted, workers.logs())
