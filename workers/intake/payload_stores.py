"""The stores payloads by reference are read from: Redis and S3-compatible object stores.

Both implement ``PayloadStore``: sizes first, then bytes, many
objects per call. Each turns the store's answers into the claim's terms: an
object's size or bytes, ``None`` for an object that does not exist, a ``Fault``
for one that cannot be served, and ``StoreOutage`` for a store that cannot be
asked (which the claims stage retries).

Redis: one pipeline of ``STRLEN`` for the sizes, one pipeline of ``GET`` for the
bytes; on a Redis Cluster (``ClusterRedisPayloads``) one such pipeline per
primary, concurrently (``common.cluster_keys``). The ACL a worker needs for
them: ``+strlen +get`` on ``conveyor:data:*``.

S3: concurrent ``HEAD`` and ``GET`` requests (at most ``concurrency`` at once),
each body read up to the size limit and no further.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.cluster_keys import per_key
from common.redis_cluster import ClusterRouter
from common.s3 import s3_fault
from schemas import DataRef, ErrorCode

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

T = TypeVar("T")

__all__ = [
    "ClusterRedisPayloads",
    "Fault",
    "PayloadStore",
    "RedisPayloads",
    "S3Payloads",
    "StoreOutage",
    "too_large",
]

_READ_CHUNK = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Fault:
    """Why one referenced object cannot be served (an error result for its request)."""

    code: ErrorCode
    message: str


class StoreOutage(Exception):
    """A store could not be asked at all (unreachable, timed out, failing): retry later."""


class PayloadStore(Protocol):
    """One kind of store: sizes and bytes of many objects."""

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        """Per reference, the object's size in bytes, a ``Fault``, or None (missing).

        Raises ``StoreOutage`` when the store cannot answer.
        """

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        """Per reference, the object's bytes, a ``Fault`` (e.g. larger than ``max_bytes``),
        or None (missing). Raises ``StoreOutage`` when the store cannot answer."""


def too_large(ref: DataRef, size: int, limit: int) -> Fault:
    """The fault of an object larger than a worker's ``max_dataref_bytes``."""
    return Fault(
        ErrorCode.dataref_too_large,
        f"{ref.uri} is {size} bytes, more than this worker's max_dataref_bytes ({limit}); "
        "send a smaller payload",
    )


class RedisPayloads:
    """Payloads stored as Redis strings (``redis:<key>``), in the worker's own Redis."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        answers = await self._ask(refs, lambda pipe, key: pipe.strlen(key))
        # STRLEN says 0 for a key that does not exist (and for an empty value, which
        # no request may have either).
        return [
            _command_fault(ref, answer) if isinstance(answer, Exception) else int(answer) or None
            for ref, answer in zip(refs, answers, strict=True)
        ]

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        answers = await self._ask(refs, lambda pipe, key: pipe.get(key))
        out: list[bytes | Fault | None] = []
        for ref, answer in zip(refs, answers, strict=True):
            if isinstance(answer, Exception):
                out.append(_command_fault(ref, answer))
            elif isinstance(answer, bytes) and len(answer) > max_bytes:
                out.append(too_large(ref, len(answer), max_bytes))  # grew since its size
            else:
                out.append(answer)
        return out

    async def _ask(
        self, refs: Sequence[DataRef], command: Callable[[Any, str], object]
    ) -> list[Any]:
        """One command per reference, in one pipeline; per-key errors as exception objects."""
        pipe = self._redis.pipeline(transaction=False)
        for ref in refs:
            command(pipe, ref.key)
        try:
            answers: list[Any] = await pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreOutage(f"Redis: {type(exc).__name__}: {exc}") from exc
        except RedisError as exc:  # e.g. LOADING, READONLY during a failover
            raise StoreOutage(f"Redis: {type(exc).__name__}: {exc}") from exc
        return answers


class ClusterRedisPayloads(RedisPayloads):
    """``RedisPayloads`` on a Redis Cluster: one pipeline per primary that holds keys."""

    def __init__(self, router: ClusterRouter, budget_s: float = 10.0) -> None:
        self._router = router
        self._budget_s = budget_s

    async def _ask(
        self, refs: Sequence[DataRef], command: Callable[[Any, str], object]
    ) -> list[Any]:
        try:
            by_key = await per_key(self._router, {ref.key for ref in refs}, command, self._budget_s)
        except (RedisError, OSError) as exc:  # still failing over, or every node down
            raise StoreOutage(f"Redis Cluster: {type(exc).__name__}: {exc}") from exc
        return [by_key[ref.key] for ref in refs]


def _command_fault(ref: DataRef, error: Exception) -> Fault:
    """A per-key error of one command: a wrong type, or a key outside the worker's ACL."""
    text = str(error)
    if isinstance(error, ResponseError) and text.startswith("NOPERM"):
        return Fault(
            ErrorCode.dataref_denied,
            f"this worker's Redis user may not read {ref.key!r} ({text})",
        )
    if isinstance(error, ResponseError) and text.startswith("WRONGTYPE"):
        return Fault(
            ErrorCode.dataref_missing,
            f"{ref.uri} is not a string key (Redis: {text}); store the payload with SET",
        )
    raise StoreOutage(f"Redis: {type(error).__name__}: {text}")


class S3Payloads:
    """Payloads stored as objects of an S3-compatible store (``s3://bucket/key``)."""

    def __init__(self, client: S3Client, concurrency: int = 16) -> None:
        self._s3 = client
        self._slots = asyncio.Semaphore(concurrency)

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        async def size(ref: DataRef) -> int:
            head = await self._s3.head_object(Bucket=ref.bucket, Key=ref.key)
            return int(head["ContentLength"])

        return await self._each(refs, size)

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        async def read(ref: DataRef) -> bytes | Fault:
            response = await self._s3.get_object(Bucket=ref.bucket, Key=ref.key)
            size = int(response["ContentLength"])
            async with response["Body"] as body:
                if size > max_bytes:  # replaced by a larger object since its HEAD
                    return too_large(ref, size, max_bytes)
                chunks = []
                while chunk := await body.read(_READ_CHUNK):
                    chunks.append(chunk)
            return b"".join(chunks)

        return await self._each(refs, read)

    async def _each(
        self, refs: Sequence[DataRef], call: Callable[[DataRef], Awaitable[T]]
    ) -> list[T | Fault | None]:
        async def bounded(ref: DataRef) -> T:
            async with self._slots:
                return await call(ref)

        answers = await asyncio.gather(*(bounded(ref) for ref in refs), return_exceptions=True)
        out: list[T | Fault | None] = []
        for ref, answer in zip(refs, answers, strict=True):
            if not isinstance(answer, BaseException):
                out.append(answer)
                continue
            kind = s3_fault(answer)
            if kind == "missing":
                out.append(None)
            elif kind == "denied":
                out.append(
                    Fault(ErrorCode.dataref_denied, f"the store refused {ref.uri}: {answer}")
                )
            elif kind == "outage":
                raise StoreOutage(f"S3: {type(answer).__name__}: {answer}") from answer
            else:
                raise answer
        return out
