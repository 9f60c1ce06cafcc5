"""Read results from Redis: one read now, or wait for them without polling.

A worker writes a result with ``SET conveyor:result:<id> ... NX`` and then
publishes an empty message on the channel of the same name. Waiting is

1. SUBSCRIBE to the channels and wait until Redis confirms the subscription,
2. read the keys (MGET), yielding what is already there,
3. on each notification, read the notified keys again.

The order matters: a result written after step 1 is announced to us, and one
written before it is found in step 2, so none is ever missed. Reading before
subscribing would lose a result that lands between the two. Every wait
subscribes on its own pub/sub connection and gives it back when it ends,
however it ends (result, timeout, error, cancellation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.security import redis_options
from producers.errors import ResultTimeout, ServiceUnavailable
from producers.settings import ClientSettings
from schemas import Result, cancel_key, decode_result, result_key, status_key

T = TypeVar("T")
# Keys per MGET and channels per SUBSCRIBE: one round trip each, none of them huge.
_CHUNK = 500
# Notifications drained at once before reading their keys with one MGET.
_DRAIN = 500


@dataclass(frozen=True)
class RequestStatus:
    """Where a request stands: ``queued`` (no worker has started it: waiting in its
    topic, or an id that was never sent), ``running`` (a worker started its batch;
    seen only when workers track status) or ``done`` (``result`` holds its answer)."""

    id: str
    state: Literal["queued", "running", "done"]
    result: Result | None = None
    attempt: int | None = None
    """Starts so far (with status tracking), this one included."""
    worker: str | None = None
    """The worker that started it last."""
    started_ms: int | None = None
    """When that worker started it, epoch milliseconds."""

    def document(self) -> dict[str, Any]:
        """As JSON: the result document when done, else the state and what is known."""
        if self.result is not None:
            return {
                "id": self.id,
                "state": self.state,
                "result": self.result.model_dump(mode="json"),
            }
        fields = {"attempt": self.attempt, "worker": self.worker, "started_ms": self.started_ms}
        return {"id": self.id, "state": self.state} | {
            name: value for name, value in fields.items() if value is not None
        }


class ResultReader:
    """Reads and waits for results in Redis; owns one connection pool."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.redis_url.get_secret_value(),
            socket_connect_timeout=settings.connect_timeout_s,
            socket_timeout=settings.connect_timeout_s,
            client_name=settings.redis_client_name,
            **redis_options(settings),
        )
        # Pub/sub connections of waits in progress, closed by close() if still open.
        self._subscriptions: set[PubSub] = set()

    async def close(self) -> None:
        """Give back every connection, those of unfinished waits included."""
        for pubsub in list(self._subscriptions):
            await _release(pubsub)
        self._subscriptions.clear()
        await self._redis.aclose()

    async def get(self, request_id: str) -> Result | None:
        """The result now, or None while it is pending: one GET."""
        key = result_key(request_id)
        raw = await self._bounded(self._redis.get(key))
        return None if raw is None else _decode(raw)

    async def status(self, request_id: str) -> RequestStatus:
        """Where the request stands now: one pipelined GET and HGETALL."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(result_key(request_id))
        pipe.hgetall(status_key(request_id))
        raw, fields = await self._bounded(pipe.execute())
        return _status(request_id, raw, fields)

    async def cancel(self, request_id: str, ttl_s: int) -> RequestStatus:
        """Set the request's cancel key (kept ``ttl_s``); where it stood then."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(cancel_key(request_id), b"1", ex=ttl_s)
        pipe.get(result_key(request_id))
        pipe.hgetall(status_key(request_id))
        _, raw, fields = await self._bounded(pipe.execute())
        return _status(request_id, raw, fields)

    async def wait_many(
        self,
        request_ids: Iterable[str],
        timeout: float,  # noqa: ASYNC109 - expiry must raise ResultTimeout naming the ids
    ) -> AsyncGenerator[Result, None]:
        """Yield each request's result as it becomes available, in completion order.

        Raises ``ResultTimeout`` naming the ids still pending after ``timeout``
        seconds. Ids given twice are waited for once.
        """
        pending = {result_key(i): i for i in dict.fromkeys(request_ids)}
        if not pending:
            return
        deadline = time.monotonic() + timeout
        async with self._subscribed(list(pending)) as (pubsub, notified):
            to_read = list(pending)
            while pending:
                for result in await self._read(to_read, pending):
                    yield result
                if not pending:
                    return
                to_read = await self._next_notified(pubsub, notified, pending, deadline)
                if not to_read:
                    raise ResultTimeout(list(pending.values()), timeout)

    @asynccontextmanager
    async def _subscribed(self, channels: Sequence[str]) -> AsyncIterator[tuple[PubSub, set[str]]]:
        """A pub/sub connection subscribed to ``channels``, confirmed by Redis.

        Yields it with the set of channels notified while waiting for the
        confirmations; they must be read too.
        """
        pubsub = self._redis.pubsub()
        self._subscriptions.add(pubsub)
        try:
            notified: set[str] = set()
            await self._subscribe(pubsub, channels, notified)
            yield pubsub, notified
        finally:
            self._subscriptions.discard(pubsub)
            await _release(pubsub)

    async def _subscribe(self, pubsub: PubSub, channels: Sequence[str], notified: set[str]) -> None:
        async def subscribe_and_confirm() -> None:
            for start in range(0, len(channels), _CHUNK):
                await pubsub.subscribe(*channels[start : start + _CHUNK])
            # SUBSCRIBE only sends; Redis has subscribed us once it confirms. Until
            # then a result published on another connection could pass us by.
            confirmed = 0
            while confirmed < len(channels):
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    confirmed += 1
                elif message["type"] == "message":
                    notified.add(_text(message["channel"]))

        await self._bounded(subscribe_and_confirm())

    async def _read(self, keys: Sequence[str], pending: dict[str, str]) -> list[Result]:
        """Results of ``keys`` that are there now; they leave ``pending``."""
        found = []
        for start in range(0, len(keys), _CHUNK):
            chunk = keys[start : start + _CHUNK]
            values = await self._bounded(self._redis.mget(chunk))
            for key, raw in zip(chunk, values, strict=True):
                if raw is not None and key in pending:
                    del pending[key]
                    found.append(_decode(raw))
        return found

    async def _next_notified(
        self, pubsub: PubSub, notified: set[str], pending: dict[str, str], deadline: float
    ) -> list[str]:
        """Pending keys notified since the last read, waiting until ``deadline`` for one.

        Returns an empty list when the deadline passed with no notification.
        """
        while not (ready := [key for key in notified if key in pending]):
            notified.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            message = await self._redis_errors(pubsub.get_message(timeout=remaining))
            # Take whatever else has arrived too, so a burst costs one MGET.
            for _ in range(_DRAIN):
                if message is None:
                    break
                if message["type"] == "message":
                    notified.add(_text(message["channel"]))
                message = await self._redis_errors(pubsub.get_message(timeout=0))
        notified.clear()
        return ready

    async def _bounded(self, operation: Awaitable[T]) -> T:
        """Run one Redis operation, turning an unreachable Redis into ``ServiceUnavailable``."""
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                return await self._redis_errors(operation)
        except TimeoutError:
            raise self._unavailable(
                f"no answer in {self._settings.connect_timeout_s:g} s"
            ) from None

    async def _redis_errors(self, operation: Awaitable[T]) -> T:
        try:
            return await operation
        # InvalidResponse: something that is not Redis answers at that address.
        except (RedisConnectionError, RedisTimeoutError, InvalidResponse) as exc:
            raise self._unavailable(str(exc)) from exc

    def _unavailable(self, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"cannot reach Redis at {self._settings.redis_location} ({why}): "
            "is it running (`make up`)? Point the client at it with --redis-url or "
            "CONVEYOR_REDIS_URL, and check the CONVEYOR_REDIS_* security settings"
        )


def request_status(request_id: str, raw: bytes | None, fields: dict[bytes, bytes]) -> RequestStatus:
    """The status that a request's result value and status hash (both as read) say."""
    return _status(request_id, raw, fields)


def _status(request_id: str, raw: bytes | None, fields: dict[bytes, bytes]) -> RequestStatus:
    if raw is not None:
        return RequestStatus(request_id, "done", result=_decode(raw))
    if not fields:
        return RequestStatus(request_id, "queued")
    attempt, worker, started = (fields.get(f) for f in (b"attempt", b"worker", b"started_ms"))
    return RequestStatus(
        request_id,
        "running",
        attempt=int(attempt) if attempt is not None else None,
        worker=worker.decode(errors="replace") if worker is not None else None,
        started_ms=int(started) if started is not None else None,
    )


async def _release(pubsub: PubSub) -> None:
    """Unsubscribe by disconnecting, and give the connection back to the pool."""
    await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py


def _decode(raw: bytes | str) -> Result:
    # The client never asks redis-py to decode responses, so values are bytes.
    return decode_result(raw if isinstance(raw, bytes) else raw.encode())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
