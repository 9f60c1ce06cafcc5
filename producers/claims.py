"""Store large payloads and send a reference instead (the claim-check pattern).

A payload larger than ``dataref_threshold_bytes`` is stored in Redis (``SET key
value EX dataref_ttl_s``, key ``conveyor:data:<request id>``) or in an
S3-compatible bucket (object ``<dataref_s3_prefix><request id>``), and its
request record carries ``ce_dataref`` naming it, ``ce_dataexpires`` saying how
long it is kept, and an empty value (docs/contract.md). Payloads are stored
before any record is sent, so a record never points at nothing. Stored payloads
are never deleted by Conveyor: a redelivered request reads its payload again;
they go with their TTL (Redis) or the bucket's lifecycle rule (S3).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from common.cluster_keys import per_key
from common.redis_cluster import ClusterRouter
from common.s3 import S3Unavailable, s3_client, s3_fault
from common.security import redis_options
from producers.errors import ClientError, ServiceUnavailable
from producers.settings import ClientSettings
from schemas import payload_key, redis_dataref, s3_dataref

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

_PIPELINE_BYTES = 64 * 1024 * 1024  # payload bytes per Redis pipeline round trip
_S3_CONCURRENCY = 8


class PayloadStoreRefused(ClientError):
    """The payload store refused to store a payload (access denied, no such bucket)."""


class Uploader:
    """Stores payloads for one client; connections open on first use."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._redis: aioredis.Redis | None = None
        self._router: ClusterRouter | None = None
        self._s3: S3Client | None = None
        self._s3_context: contextlib.AsyncExitStack | None = None

    def wants(self, size: int) -> bool:
        """Whether a payload of ``size`` bytes goes by reference."""
        settings = self._settings
        return settings.dataref_store != "off" and size > settings.dataref_threshold_bytes

    @property
    def max_bytes(self) -> int:
        """The largest payload this client sends (by reference when it may)."""
        limits = self._settings.limits
        if self._settings.dataref_store == "off":
            return limits.max_payload_bytes
        return max(limits.max_payload_bytes, limits.max_dataref_bytes)

    def reference(self, request_id: str) -> tuple[str, datetime]:
        """The ``ce_dataref`` and ``ce_dataexpires`` of request ``request_id``'s payload."""
        settings = self._settings
        expires = datetime.now(UTC) + timedelta(seconds=settings.dataref_ttl_s)
        if settings.dataref_store == "s3":
            assert settings.dataref_s3_bucket is not None  # the settings check it
            key = settings.dataref_s3_prefix + request_id
            return s3_dataref(settings.dataref_s3_bucket, key), expires
        return redis_dataref(payload_key(request_id, settings.dataref_redis_prefix)), expires

    async def store(self, payloads: Sequence[tuple[str, bytes]]) -> None:
        """Store ``(request id, payload)`` pairs where ``reference`` says they are."""
        if not payloads:
            return
        if self._settings.dataref_store == "s3":
            await self._store_s3(payloads)
        else:
            await self._store_redis(payloads)

    async def close(self) -> None:
        if self._redis is not None:
            redis, self._redis = self._redis, None
            await redis.aclose()
        if self._router is not None:
            router, self._router = self._router, None
            await router.aclose()
        if self._s3_context is not None:
            context, self._s3_context, self._s3 = self._s3_context, None, None
            await context.aclose()

    async def _store_redis(self, payloads: Sequence[tuple[str, bytes]]) -> None:
        settings = self._settings
        if settings.redis_cluster:
            await self._store_redis_cluster(payloads)
            return
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(
                settings.redis_url.get_secret_value(),
                socket_connect_timeout=settings.connect_timeout_s,
                socket_timeout=settings.send_timeout_s,
                client_name=settings.redis_client_name,
                **redis_options(settings),
            )
        pipe = self._redis.pipeline(transaction=False)
        queued = 0
        try:
            for request_id, data in payloads:
                key = payload_key(request_id, settings.dataref_redis_prefix)
                pipe.set(key, data, ex=settings.dataref_ttl_s)
                queued += len(data)
                if queued >= _PIPELINE_BYTES:
                    await pipe.execute()
                    queued = 0
            await pipe.execute()
        except (NoPermissionError, AuthenticationError) as exc:
            raise _refused_by_redis(settings, exc) from exc
        except (RedisError, OSError) as exc:
            raise ServiceUnavailable(
                f"cannot store payloads in Redis at {settings.redis_location} "
                f"({type(exc).__name__}: {exc}); nothing was sent"
            ) from exc

    async def _store_redis_cluster(self, payloads: Sequence[tuple[str, bytes]]) -> None:
        """The same ``SET``s on a Redis Cluster: one pipeline per primary."""
        settings = self._settings
        if self._router is None:
            self._router = ClusterRouter(
                settings.redis_url.get_secret_value(),
                {
                    "socket_connect_timeout": settings.connect_timeout_s,
                    "socket_timeout": settings.send_timeout_s,
                    "client_name": settings.redis_client_name,
                    **redis_options(settings),
                },
            )
        data = {payload_key(i, settings.dataref_redis_prefix): d for i, d in payloads}
        try:
            answers = await per_key(
                self._router,
                data,
                lambda pipe, key: pipe.set(key, data[key], ex=settings.dataref_ttl_s),
                settings.connect_timeout_s,
            )
        except (RedisError, OSError) as exc:
            answers = {"": exc}
        failed = [answer for answer in answers.values() if isinstance(answer, Exception)]
        refused = [f for f in failed if isinstance(f, NoPermissionError | AuthenticationError)]
        if refused:
            raise _refused_by_redis(settings, refused[0])
        if failed:
            raise ServiceUnavailable(
                f"cannot store payloads in the Redis Cluster at {settings.redis_location} "
                f"({type(failed[0]).__name__}: {failed[0]}); nothing was sent"
            )

    async def _store_s3(self, payloads: Sequence[tuple[str, bytes]]) -> None:
        settings = self._settings
        bucket = settings.dataref_s3_bucket
        assert bucket is not None  # the settings check it
        s3 = await self._s3_client()
        slots = asyncio.Semaphore(_S3_CONCURRENCY)

        async def put(request_id: str, data: bytes) -> Any:
            async with slots:
                return await s3.put_object(
                    Bucket=bucket, Key=settings.dataref_s3_prefix + request_id, Body=data
                )

        results = await asyncio.gather(
            *(put(request_id, data) for request_id, data in payloads), return_exceptions=True
        )
        for result in results:
            if not isinstance(result, BaseException):
                continue
            where = f"bucket {bucket} at {settings.s3_endpoint_url or 'AWS S3'}"
            if s3_fault(result) == "outage":
                raise ServiceUnavailable(
                    f"cannot store payloads in {where} ({result}); nothing was sent"
                ) from result
            if s3_fault(result) is not None:
                raise PayloadStoreRefused(
                    f"{where} refused a payload ({result}); check the bucket and the "
                    "CONVEYOR_S3_* credentials; nothing was sent"
                ) from result
            raise result

    async def _s3_client(self) -> S3Client:
        if self._s3 is None:
            context = contextlib.AsyncExitStack()
            try:
                self._s3 = await context.enter_async_context(s3_client(self._settings))
            except S3Unavailable as exc:
                raise ClientError(str(exc)) from None
            self._s3_context = context
        return self._s3


def _refused_by_redis(settings: ClientSettings, exc: BaseException) -> PayloadStoreRefused:
    """Redis would not let this caller store a payload: retrying cannot help."""
    return PayloadStoreRefused(
        f"Redis at {settings.redis_location} refused to store a payload "
        f"({type(exc).__name__}: {exc}): payloads above dataref_threshold_bytes "
        f"({settings.dataref_threshold_bytes}) are stored under "
        f"{settings.dataref_redis_prefix}*, which needs +set on that pattern for this "
        "Redis user (docs/security.md), or set CONVEYOR_DATAREF_STORE to s3 or off; "
        "nothing was sent"
    )
