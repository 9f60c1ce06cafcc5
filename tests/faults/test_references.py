"""Payloads by reference through real workers, Kafka, Redis and SeaweedFS's S3 gateway.

- the SDK stores payloads above its threshold in Redis or S3 and the worker serves
  them; an object that is missing gets ``dataref_missing``;
- a 50 MB image goes through a request topic whose ``max.message.bytes`` is 1 MB,
  with the worker's resident memory bounded by the fetch and decode budgets;
- the object store stopped mid-run: requests wait and are retried, none is lost.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from PIL import Image
from pydantic import SecretStr

from producers import AsyncClient, ClientSettings
from schemas import ContentType, ErrorCode, Status, encode_request, redis_dataref, topics_for
from tests.faults.conftest import Workers, admin_for
from tests.integration.harness import create_model_topics, produce, wait_for_results


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
