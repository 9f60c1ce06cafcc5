"""The payload stores of claims against the real Redis and SeaweedFS's S3 gateway:
sizes, bytes, missing objects, refused access, an unreachable store.

Requests sent by reference through real workers: tests/faults/test_references.py.
"""

from __future__ import annotations

import socket

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from common.s3 import S3Settings, s3_client
from schemas import ErrorCode, parse_dataref, redis_dataref, s3_dataref
from workers.intake.payload_stores import Fault, RedisPayloads, S3Payloads, StoreOutage


async def test_redis_payloads_sizes_bytes_missing_and_wrong_type(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    await redis_client.set(f"{redis_prefix}a", b"x" * 3000)
    await redis_client.hset(f"{redis_prefix}hash", "f", "v")
    refs = [parse_dataref(redis_dataref(f"{redis_prefix}{name}")) for name in ("a", "none", "hash")]
    store = RedisPayloads(redis_client)
    sizes = await store.sizes(refs)
    assert sizes[:2] == [3000, None]
    assert isinstance(sizes[2], Fault)
    assert sizes[2].code is ErrorCode.dataref_missing
    read = await store.read(refs[:2], max_bytes=10_000)
    assert read == [b"x" * 3000, None]
    too_large = (await store.read(refs[:1], max_bytes=100))[0]
    assert isinstance(too_large, Fault)
    assert too_large.code is ErrorCode.dataref_too_large


async def test_an_unreachable_redis_is_an_outage() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1)
    try:
        with pytest.raises(StoreOutage):
            await RedisPayloads(client).sizes([parse_dataref("redis:k")])
    finally:
        await client.aclose()


async def test_s3_payloads_sizes_bytes_missing_and_refused(
    s3_options: dict[str, str], s3_bucket: str
) -> None:
    settings = S3Settings.model_validate(s3_options)
    async with s3_client(settings) as s3:
        await s3.put_object(Bucket=s3_bucket, Key="in/a b.bin", Body=b"y" * 5000)
        refs = [
            parse_dataref(s3_dataref(s3_bucket, "in/a b.bin")),
            parse_dataref(s3_dataref(s3_bucket, "in/none")),
            parse_dataref(s3_dataref("no-such-bucket-here", "k")),
        ]
        store = S3Payloads(s3)
        assert await store.sizes(refs) == [5000, None, None]
        assert await store.read(refs[:2], max_bytes=10_000) == [b"y" * 5000, None]
        too_large = (await store.read(refs[:1], max_bytes=100))[0]
        assert isinstance(too_large, Fault)
        assert too_large.code is ErrorCode.dataref_too_large
    wrong = S3Settings.model_validate(
        s3_options | {"s3_secret_access_key": SecretStr("not-the-secret")}
    )
    async with s3_client(wrong) as s3:
        refused = (await S3Payloads(s3).sizes(refs[:1]))[0]
        assert isinstance(refused, Fault)
        assert refused.code is ErrorCode.dataref_denied


async def test_an_unreachable_s3_store_is_an_outage(s3_options: dict[str, str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = S3Settings.model_validate(
        s3_options | {"s3_endpoint_url": f"http://127.0.0.1:{port}"}
    )
    async with s3_client(settings) as s3:
        with pytest.raises(StoreOutage):
            await S3Payloads(s3).sizes([parse_dataref("s3://bucket/key")])
