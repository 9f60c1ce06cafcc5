"""Payloads by reference through real workers, Kafka, Redis and SeaweedFS's S3 gateway.

- the SDK stores payloads above its threshold in Redis or S3 and the worker serves
  them; an object that is missing gets ``dataref_missing``;
- a 50 MB image goes through a request topic whose ``max.message.bytes`` is 1 MB,
  with the worker's resident memory bounded by the fetch and decode budgets;
- the object store stopped mid-run: requests wait and are retried, none is lost.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from aiokafka.admin import NewTopic
from PIL import Image
from pydantic import SecretStr

from common.s3 import S3Settings, s3_client
from producers import AsyncClient, ClientSettings
from schemas import ContentType, ErrorCode, Status, encode_request, redis_dataref, topics_for
from tests.faults.conftest import (
    LocalService,
    Workers,
    admin_for,
    check,
    tally,
    until_answered,
)
from tests.faults.test_reliability import FAULTY, _metric
from tests.integration.harness import (
    count_results,
    create_model_topics,
    produce,
    redis_results,
    wait_for_results,
)


def _png(side: int, seed: int = 0) -> bytes:
    """A noise PNG: it barely compresses, so its size is about side² × 3 bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


@pytest.mark.timeout(240)
async def test_the_sdk_sends_large_payloads_by_reference_through_redis_and_s3(
    workers: Workers,
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    model_name: str,
    s3_options: dict[str, str],
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """A 1 MB image goes by reference (Redis, then S3), a small one in the record; a
    referenced object deleted before the worker reads it gets dataref_missing."""
    async with admin_for(kafka_bootstrap) as admin:
        await create_model_topics(admin, model_name, partitions=1)
    big, small = _png(600, seed=1), _png(8, seed=2)
    assert len(big) > 768 * 1024
    common = {"kafka_bootstrap": kafka_bootstrap, "redis_url": SecretStr(redis_url)}
    async with AsyncClient(ClientSettings(**common)) as client:
        via_redis = await client.submit_many([big, small], model=model_name)
    via_redis_record = await redis_client.get(f"conveyor:data:{via_redis[0]}")
    assert via_redis_record == big  # stored, with a TTL
    assert 0 < await redis_client.ttl(f"conveyor:data:{via_redis[0]}") <= 3600
    assert await redis_client.exists(f"conveyor:data:{via_redis[1]}") == 0  # sent inline
    s3_client_settings = ClientSettings(
        **common, **s3_options, dataref_store="s3", dataref_s3_bucket=s3_bucket
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
    workers.start(
        "--dataref-s3-buckets",
        s3_bucket,
        *(f"--{name.replace('_', '-')}={value}" for name, value in s3_options.items()),
    )
    ids = [*via_redis, via_s3, gone]
    results = await wait_for_results(redis_url, ids, timeout=180)
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


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _s3_flags(options: dict[str, str], bucket: str) -> list[str]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    return ["--dataref-s3-buckets", bucket, *flags]


@pytest.mark.timeout(300)
async def test_a_50_mb_image_through_a_1_mb_topic_with_bounded_memory(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    s3_options: dict[str, str],
    s3_bucket: str,
) -> None:
    """Three 50 MB images by reference (S3) through a request topic that takes 1 MB
    records: all served; the worker's resident memory grows by less than the fetch
    budget, one S3 body being joined, the decode budget and slack."""
    topics = topics_for(model_name)
    async with admin_for(kafka_bootstrap) as admin:
        await admin.create_topics(
            [
                NewTopic(topics.requests, 1, 1, topic_configs={"max.message.bytes": "1048588"}),
                NewTopic(topics.results, 1, 1),
                NewTopic(topics.dlq, 1, 1),
            ]
        )
    image = _png(OBJECT_SIDE, seed=3)
    object_mb = len(image) / 2**20
    assert object_mb > 48
    settings = ClientSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=SecretStr(redis_url),
        dataref_store="s3",
        dataref_s3_bucket=s3_bucket,
        **s3_options,
    )
    worker = workers.start(
        "--decode-memory-mb",
        str(BUDGET_MB),
        "--decode-threads",
        "4",
        *_s3_flags(s3_options, s3_bucket),
    )
    async with AsyncClient(settings) as client:
        warm = await client.submit(digits[0][0], model=model_name)  # small: in the record
        assert (await client.wait(warm, timeout=120)).status is Status.ok
        assert worker.proc is not None
        baseline = _rss_mb(worker.proc.pid)
        ids = await client.submit_many([image] * 3, model=model_name)
        peak = baseline
        done = asyncio.ensure_future(wait_for_results(redis_url, ids, timeout=240))
        while not done.done():
            peak = max(peak, _rss_mb(worker.proc.pid))
            await asyncio.sleep(0.02)
        results = await done
    assert {results[i].status for i in ids} == {Status.ok}, workers.logs()[-3000:]
    bound = 2 * BUDGET_MB + object_mb + RSS_SLACK_MB
    assert peak - baseline < bound, f"RSS grew {peak - baseline:.0f} MB (bound {bound:.0f})"
    print(f"50 MB images: RSS grew {peak - baseline:.0f} MB of a {bound:.0f} MB bound")


@pytest.mark.timeout(300)
async def test_the_object_store_stopped_mid_run_loses_nothing(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    s3_options: dict[str, str],
    private_s3: LocalService,
) -> None:
    """Every payload in S3; the store stops for 5 s while the worker serves them."""
    options = s3_options | {"s3_endpoint_url": f"http://127.0.0.1:{private_s3.port}"}
    bucket = "payloads"
    async with s3_client(S3Settings.model_validate(options)) as s3:
        await s3.create_bucket(Bucket=bucket)
    async with admin_for(kafka_bootstrap) as admin:
        await create_model_topics(admin, model_name, partitions=3)
    settings = ClientSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=SecretStr(redis_url),
        dataref_store="s3",
        dataref_s3_bucket=bucket,
        dataref_threshold_bytes=1,  # every payload by reference
        **options,
    )
    n = 600
    payloads = [digits[i % len(digits)][0] for i in range(n)]
    async with AsyncClient(settings) as client:
        ids = await client.submit_many(
            payloads, model=model_name, request_ids=[f"{model_name}-{i}" for i in range(n)]
        )
    worker = workers.start(
        "--max-batch-size",
        "8",
        *_s3_flags(options, bucket),
        spec=FAULTY,
        env={"CONVEYOR_TEST_SLOW_MS": "50"},  # about 160 requests/s
    )
    await until_answered(redis_url, ids, 80)
    private_s3.stop()
    await asyncio.sleep(5)  # the outage itself, not a wait for readiness
    stalled = await count_results(redis_url, ids)
    private_s3.start()
    row = await tally(
        "object store (S3) stopped 5 s mid-run", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    assert {r.status for r in results.values()} == {Status.ok}
    assert stalled < n  # the outage did hold requests back
    retries = await _metric(worker, "conveyor_dataref_retries_total")
    assert retries > 0
