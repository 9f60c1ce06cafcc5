"""Read results from a standalone Redis: one read now, or wait for them without polling.

Waiting follows ``producers.waiting``: subscribe to the keys' channels, wait
until Redis confirms, read the keys, then read again what is announced, so no
result is ever missed. Every wait of a client shares one pub/sub connection
(``producers.subscriber``); reads, status and cancellations share a pool of at
most ``redis_max_connections`` connections, and a call that finds them all busy
waits for one (up to ``redis_pool_timeout_s``, then ``ConnectionsBusy``) instead
of failing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.security import redis_options
from producers.errors import ConnectionsBusy, ServiceUnavailable
from producers.settings import ClientSettings
from producers.subscriber import Listener, SharedSubscriber, SubscriptionLost
from producers.waiting import raise_if_cancelled, wait_for_results
from schemas import Result, cancel_key, decode_result, result_key, status_key

T = TypeVar("T")
_CHUNK = 500  # keys per MGET: one round trip each, none of them huge
_NO_POOL_MESSAGE = "No connection available."  # redis-py's BlockingConnectionPool, timed out

State = Literal["unknown", "queued", "running", "done"]


@dataclass(frozen=True)
class RequestStatus:
    """Where a request stands.

    - ``done``: ``result`` holds its answer;
    - ``running``: a worker started its batch (seen only when workers track status);
    - ``queued``: no worker has started it. With ``sent_ms``, a client recorded
      sending it; without, it may be waiting in its topic, or no request with
      that id was ever sent: Redis cannot tell these apart unless clients track
      status (``ClientSettings.track_status``);
    - ``unknown``: clients track status and none recorded sending it, no worker
      started it and it has no result: no request with that id is known (never
      sent, or sent so long ago that its records expired).
    """

    id: str
    state: State
    result: Result | None = None
    attempt: int | None = None
    """Starts so far (with status tracking), this one included."""
    worker: str | None = None
    """The worker that started it last."""
    started_ms: int | None = None
    """When that worker started it, epoch milliseconds."""
    sent_ms: int | None = None
    """When a client that tracks status sent it, epoch milliseconds."""

    def document(self) -> dict[str, Any]:
        """As JSON: the result document when done, else the state and what is known."""
        if self.result is not None:
            return {
                "id": self.id,
                "state": self.state,
                "result": self.result.model_dump(mode="json"),
            }
        fields = {
            "attempt": self.attempt,
            "worker": self.worker,
            "started_ms": self.started_ms,
            "sent_ms": self.sent_ms,
        }
        return {"id": self.id, "state": self.state} | {
            name: value for name, value in fields.items() if value is not None
        }


class ResultReader:
    """Reads and waits for results in Redis: a pool for commands, one connection for waits."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        url = settings.redis_url.get_secret_value()
        options: dict[str, Any] = {
            "socket_connect_timeout": settings.connect_timeout_s,
            "socket_timeout": settings.connect_timeout_s,
            "client_name": settings.redis_client_name,
            **redis_options(settings),
        }
        pool = _WaitingPool.from_url(
            url,
            max_connections=settings.redis_max_connections,
            timeout=settings.redis_pool_timeout_s,
            **options,
        )
        self._redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        # No retries: redis-py's would reconnect the subscription (producers.subscriber).
        no_retries = Retry(NoBackoff(), 0, supported_errors=())
        self._subscriber_options = {**options, "retry": no_retries}
        self._subscriber: SharedSubscriber | None = None
        self._closed = False

    async def close(self) -> None:
        """Give back every connection, that of unfinished waits included."""
        self._closed = True
        try:
            if self._subscriber is not None:
                await self._subscriber.aclose()
        finally:
            await self._redis.aclose()

    async def get(self, request_id: str) -> Result | None:
        """The result now, or None while it is pending: one GET."""
        key = result_key(request_id)
        raw = await self._bounded(self._redis.get(key))
        return None if raw is None else _decode(raw)

    async def read_stream(
        self, key: str, last_id: str, block_ms: int, count: int
    ) -> list[tuple[str, Mapping[str, str]]]:
        """The entries of the stream ``key`` after ``last_id``: one ``XREAD``, waiting up to
        ``block_ms`` for the first (``producers.token_stream``)."""
        answer: Any = await self._bounded(
            self._redis.xread({key: last_id}, count=count, block=block_ms)
        )
        return xread_entries(answer)

    async def status(self, request_id: str) -> RequestStatus:
        """Where the request stands now: one pipelined GET and HGETALL."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(result_key(request_id))
        pipe.hgetall(status_key(request_id))
        raw, fields = await self._bounded(pipe.execute())
        return request_status(request_id, raw, fields, self._settings.track_status)

    async def cancel(self, request_id: str, ttl_s: int) -> RequestStatus:
        """Set the request's cancel key (kept ``ttl_s``); where it stood then."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(cancel_key(request_id), b"1", ex=ttl_s)
        pipe.get(result_key(request_id))
        pipe.hgetall(status_key(request_id))
        _, raw, fields = await self._bounded(pipe.execute())
        return request_status(request_id, raw, fields, self._settings.track_status)

    async def mark_sent(self, request_ids: Sequence[str], sent_ms: int, ttl_s: int) -> None:
        """Record that ``request_ids`` are being sent (``sent_ms`` in their status hashes)."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            key = status_key(request_id)
            pipe.hset(key, SENT_FIELD, sent_ms)
            pipe.expire(key, ttl_s)
        await self._bounded(pipe.execute())

    def wait_many(
        self,
        request_ids: Iterable[str],
        timeout: float,
    ) -> AsyncGenerator[Result, None]:
        """Yield each request's result as it becomes available, in completion order
        (``producers.waiting.wait_for_results``)."""
        return wait_for_results(_Wait(self), request_ids, timeout)

    async def _shared_subscriber(self) -> SharedSubscriber:
        """The subscriber every wait uses; a new one after the last one's connection failed."""
        if self._closed:
            raise ServiceUnavailable("this client is closed")
        failed = self._subscriber
        if failed is not None and failed.failure is None:
            return failed
        # Replaced before anything is awaited, so that concurrent waits share the new one.
        subscriber = self._subscriber = SharedSubscriber(
            aioredis.Redis.from_url(
                self._settings.redis_url.get_secret_value(), **self._subscriber_options
            )
        )
        if failed is not None:
            await failed.aclose()
        return subscriber

    async def _read(self, keys: Collection[str]) -> dict[str, bytes]:
        """The values of ``keys`` that exist now: one MGET per ``_CHUNK`` keys."""
        ordered = list(keys)
        found: dict[str, bytes] = {}
        for start in range(0, len(ordered), _CHUNK):
            chunk = ordered[start : start + _CHUNK]
            values = await self._bounded(self._redis.mget(chunk))
            # The client never asks redis-py to decode responses, so values are bytes.
            found.update((k, v) for k, v in zip(chunk, values, strict=True) if isinstance(v, bytes))
        return found

    async def _bounded(self, operation: Awaitable[T]) -> T:
        """Run one Redis operation, turning an unreachable Redis into ``ServiceUnavailable``.

        The bound covers the wait for a free connection of the pool too, which ends
        first (``ConnectionsBusy``) when that is what takes the time.
        """
        settings = self._settings
        bound = settings.redis_pool_timeout_s + settings.connect_timeout_s
        try:
            async with asyncio.timeout(bound):
                answer = await self._redis_errors(operation)
        except TimeoutError:
            raise self._unavailable(f"no answer in {settings.connect_timeout_s:g} s") from None
        raise_if_cancelled()
        return answer

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


class _Wait:
    """One wait's ``producers.waiting.Subscription`` on the reader's shared subscriber."""

    def __init__(self, reader: ResultReader) -> None:
        self._reader = reader
        self._listener = Listener()
        self._subscriber: SharedSubscriber | None = None
        self._keys: list[str] = []

    async def subscribe(self, keys: Sequence[str]) -> None:
        await self._reader._bounded(self._subscribe(list(keys)))

    async def _subscribe(self, keys: list[str]) -> None:
        # A connection lost while subscribing: subscribe again on a new one, within
        # the caller's bound. One that cannot be opened raises the client's error.
        while True:
            if self._subscriber is not None:
                await self._subscriber.remove(self._listener, self._keys)
            self._keys = keys
            self._listener = Listener()
            self._subscriber = await self._reader._shared_subscriber()
            try:
                await self._subscriber.add(self._listener, keys)
                return
            except SubscriptionLost:
                if self._reader._closed:
                    raise

    async def read(self, keys: Collection[str]) -> dict[str, bytes]:
        return await self._reader._read(keys)

    async def next(self, pending: Collection[str], deadline: float) -> Collection[str] | None:
        listener = self._listener
        while True:
            if listener.lost:
                # Whatever was announced while no connection listened is unknown:
                # subscribe again (confirmed), then read every pending key again.
                again = list(pending)
                await self.subscribe(again)
                return again
            ready = [key for key in listener.notified if key in pending]
            listener.notified.clear()
            if ready:
                return ready
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    await listener.wait()
            except TimeoutError:
                return None

    async def aclose(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.remove(self._listener, self._keys)


class _WaitingPool(aioredis.BlockingConnectionPool):
    """A pool that makes callers wait for a free connection, and says so when none came."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisConnectionError as exc:
            if str(exc) == _NO_POOL_MESSAGE and isinstance(exc.__cause__, TimeoutError):
                raise ConnectionsBusy(self.max_connections, self.timeout) from exc
            raise


SENT_FIELD = "sent_ms"
"""The status hash field a client that tracks status sets when it sends a request."""
_STARTED_FIELDS = (b"attempt", b"worker", b"started_ms")


def request_status(
    request_id: str, raw: bytes | None, fields: dict[bytes, bytes], tracked: bool
) -> RequestStatus:
    """The status that a request's result value and status hash (both as read) say;
    ``tracked``: whether clients record what they send (``ClientSettings.track_status``)."""
    if raw is not None:
        return RequestStatus(request_id, "done", result=_decode(raw))
    sent = fields.get(SENT_FIELD.encode())
    sent_ms = int(sent) if sent is not None else None
    if not any(field in fields for field in _STARTED_FIELDS):
        state: State = "queued" if sent_ms is not None or not tracked else "unknown"
        return RequestStatus(request_id, state, sent_ms=sent_ms)
    attempt, worker, started = (fields.get(f) for f in _STARTED_FIELDS)
    return RequestStatus(
        request_id,
        "running",
        attempt=int(attempt) if attempt is not None else None,
        worker=worker.decode(errors="replace") if worker is not None else None,
        started_ms=int(started) if started is not None else None,
        sent_ms=sent_ms,
    )


def _decode(raw: bytes | str) -> Result:
    # The client never asks redis-py to decode responses, so values are bytes.
    return decode_result(raw if isinstance(raw, bytes) else raw.encode())


def xread_entries(answer: Any) -> list[tuple[str, Mapping[str, str]]]:
    """An ``XREAD`` answer as (entry id, fields) pairs, decoded."""
    return [
        (_text(entry_id), {_text(k): _text(v) for k, v in fields.items()})
        for _, entries in answer or []
        for entry_id, fields in entries
    ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
