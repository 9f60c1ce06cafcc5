"""The gateway's side of the queue: send a call's requests once, wait for their answers.

``Gateway.answer`` is the whole path of an infer call, whatever protocol brought it:

1. results already in Redis for its ids are the answers (a retry of a call answered
   before gets the same answer: results are first-final-wins), and each id is claimed
   (``SET conveyor:gateway:claim:<id> NX``), in one round trip: only the call that
   claims an id sends it, so a retry that arrives while the first call is in flight
   waits for the same answer instead of a second computation, on any gateway;
2. over the model's lag limit the claims are given back and the call is refused
   (``Overloaded``): back-pressure instead of a queue without bound;
3. the claimed requests go out through the SDK (``AsyncClient.submit_many``, the
   caller's ids, the caller's timeout as ``ce_deadline``, the caller's trace);
4. every id is waited for through the SDK's result channel (``wait_many``, subscribed
   while step 3 runs), up to the caller's timeout; those still pending raise
   ``AnswerTimeout`` naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar, Self

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from common.security import redis_options
from producers.client import AsyncClient
from producers.errors import ClientError, ResultTimeout, ServiceUnavailable
from producers.gateway.backlog import Backlog
from producers.gateway.settings import GatewaySettings
from producers.results import RequestStatus
from producers.token_stream import StreamEvent
from producers.tracing import continuing
from schemas import ContentType, ContractError, Result, decode_result, result_key
from schemas.description import ModelDescription, Task, decode_description, description_key

CLAIM_PREFIX = "conveyor:gateway:claim:"
"""``conveyor:gateway:claim:<request id>``: set by the gateway call that sends the id."""


class Overloaded(ClientError):
    """The model's workers are too far behind: its lag is over the gateway's limit."""

    retriable: ClassVar[bool] = True

    def __init__(self, model: str, lag: int, limit: int, retry_after_s: int) -> None:
        super().__init__(
            f"model {model} has {lag} requests waiting for its workers, more than this "
            f"gateway's limit of {limit} (CONVEYOR_GATEWAY_MAX_LAG): retry after "
            f"{retry_after_s} s, or add workers"
        )
        self.retry_after_s = retry_after_s


class AnswerTimeout(ClientError):
    """The caller's wait ended before every answer came; ``request_ids`` are still pending."""

    retriable: ClassVar[bool] = True

    def __init__(self, request_ids: Sequence[str], waited_s: float) -> None:
        self.request_ids = tuple(request_ids)
        super().__init__(
            f"no answer within {waited_s:g} s for {', '.join(self.request_ids[:5])}"
            f"{' and more' if len(self.request_ids) > 5 else ''}: the requests were sent and "
            "will be answered; read each later at /v2/results/<id>, or send the same call "
            "again with the same id (it is not computed twice)"
        )


@dataclass(frozen=True)
class Call:
    """One infer call, protocol aside."""

    model: str
    payloads: list[bytes]
    ids: list[str]
    """One request id per payload."""
    content_type: ContentType | str | None
    """Every payload's media type; None: each one's magic bytes say."""
    params: dict[str, Any]
    """``ce_params`` of every request."""
    timeout_s: float | None
    """The caller's timeout: the wait, and the requests' deadline; None: the default wait."""
    traceparent: str | None


class Gateway:
    """The connections a gateway process holds (``async with``), and the calls over them."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._client = AsyncClient(settings)
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.redis_url.get_secret_value(),
            socket_connect_timeout=settings.connect_timeout_s,
            socket_timeout=settings.connect_timeout_s,
            max_connections=settings.redis_max_connections,
            **redis_options(settings),
        )
        self._backlog = Backlog(settings, settings.gateway_lag_cache_s)

    async def __aenter__(self) -> Self:
        await self._backlog.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._client.close()
        finally:
            await self._redis.aclose()
            await self._backlog.stop()

    async def answer(self, call: Call) -> list[Result]:
        """Every request's result, in ``call.ids`` order (see the module doc).

        Raises ``Overloaded``, ``AnswerTimeout``, and the SDK's errors (``UnknownModel``,
        ``InvalidInput``, ``ServiceUnavailable``...).
        """
        wait_s = self.wait_s(call.timeout_s)
        found, mine = await self._claim(call)
        pending = [i for i in call.ids if i not in found]
        if not pending:
            return [found[i] for i in call.ids]
        # The wait subscribes while the requests are being sent: its subscription is
        # confirmed before it reads the keys, so no answer is missed either way.
        waiting = asyncio.ensure_future(self._wait(pending, wait_s))
        try:
            if mine:
                await self._send(call, mine)
        except BaseException:
            waiting.cancel()
            # Its outcome no longer matters, but it is collected (no "never retrieved").
            await asyncio.gather(waiting, return_exceptions=True)
            raise
        found.update(await waiting)
        return [found[i] for i in call.ids]

    async def send(self, call: Call) -> dict[str, Result]:
        """Steps 1 to 3 of ``answer`` without the wait: the results already there, by id;
        the requests with none are sent unless another call sent them (a generation's
        caller then reads its stream). Raises as ``answer`` does."""
        found, mine = await self._claim(call)
        if mine:
            await self._send(call, mine)
        return found

    def wait_s(self, timeout_s: float | None) -> float:
        """How long a call waits: the caller's timeout, else the default, at most the most."""
        settings = self.settings
        return min(timeout_s or settings.gateway_wait_s, settings.gateway_max_wait_s)

    def stream(self, request_id: str, timeout_s: float) -> AsyncGenerator[StreamEvent, None]:
        """The events of a generation's stream (``AsyncClient.stream``)."""
        return self._client.stream(request_id, timeout_s)

    async def result(self, request_id: str, timeout_s: float) -> Result:
        """The result of ``request_id``, waited for up to ``timeout_s``; raises
        ``AnswerTimeout``."""
        found = await self._wait([request_id], timeout_s)
        return found[request_id]

    async def cancel(self, request_id: str) -> None:
        """Cancel ``request_id`` (``AsyncClient.cancel``): a worker with
        ``--cancellation`` stops its generation within a step."""
        await self._client.cancel(request_id)

    async def generation_models(self) -> list[ModelDescription]:
        """The descriptions of every model a worker serves now whose task is text
        generation, by name."""
        keys = await self._redis_call(self._description_keys())
        if not keys:
            return []
        values = await self._redis_call(self._redis.mget(keys))
        described = []
        for raw in values:
            if raw is None:  # expired between the scan and the read
                continue
            with contextlib.suppress(ContractError):  # a key that is no description
                description = decode_description(raw)
                if description.task == Task.text_generation:
                    described.append(description)
        return sorted(described, key=lambda d: d.name)

    async def describe(self, model: str) -> ModelDescription | None:
        """The model's description as its workers last wrote it; None when no worker
        has served it within the description's TTL."""
        raw = await self._redis_call(self._redis.get(description_key(model)))
        return None if raw is None else decode_description(raw)

    async def status(self, request_id: str) -> RequestStatus:
        """Where a request stands (``AsyncClient.status``)."""
        return await self._client.status(request_id)

    async def checks(self) -> dict[str, bool]:
        """Whether Kafka and Redis answer now."""
        try:
            redis_ok = bool(await self._redis.ping())
        except (RedisError, OSError):
            redis_ok = False
        return {"kafka": await self._backlog.reachable(), "redis": redis_ok}

    async def _read_and_claim(self, ids: list[str]) -> tuple[dict[str, Result], set[str]]:
        """The results already there, and the ids this call claimed: one round trip.

        An id with a result may be claimed too (its claim had expired); it is not sent.
        """
        pipe = self._redis.pipeline(transaction=False)
        pipe.mget([result_key(i) for i in ids])
        ttl = self.settings.gateway_claim_ttl_s
        for request_id in ids:
            pipe.set(CLAIM_PREFIX + request_id, b"1", nx=True, ex=ttl)
        values, *claims = await self._redis_call(pipe.execute())
        found = {i: decode_result(v) for i, v in zip(ids, values, strict=True) if v is not None}
        return found, {i for i, won in zip(ids, claims, strict=True) if won}

    async def _description_keys(self) -> list[bytes]:
        return [k async for k in self._redis.scan_iter(match=description_key("*"), count=500)]

    async def _claim(self, call: Call) -> tuple[dict[str, Result], list[str]]:
        """The results already there, and the ids without one that this call claimed
        (given back when the model is over its lag limit)."""
        found, claimed = await self._read_and_claim(call.ids)
        mine = [i for i in call.ids if i not in found and i in claimed]
        if mine:
            try:
                await self._refuse_if_behind(call.model)
            except BaseException:
                await self._unclaim(mine)
                raise
        return found, mine

    async def _unclaim(self, ids: list[str]) -> None:
        """Give back claims of requests that were not sent, so a retry sends them."""
        # Claims that stay expire; until then a retry waits for an answer that never comes.
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(*(CLAIM_PREFIX + i for i in ids))

    async def _refuse_if_behind(self, model: str) -> None:
        limit = self.settings.gateway_max_lag
        if limit is None:
            return
        lag = await self._backlog.lag(model)
        if lag > limit:
            raise Overloaded(model, lag, limit, self.settings.gateway_retry_after_s)

    async def _send(self, call: Call, ids: list[str]) -> None:
        by_id = dict(zip(call.ids, call.payloads, strict=True))
        deadline = None if call.timeout_s is None else timedelta(seconds=call.timeout_s)
        try:
            with continuing(call.traceparent):
                await self._client.submit_many(
                    [by_id[i] for i in ids],
                    model=call.model,
                    params=call.params or None,
                    deadline=deadline,
                    request_ids=ids,
                    content_type=call.content_type,
                )
        except BaseException as exc:
            # A send that failed gives its claims back, so that a retry sends them; one
            # cancelled midway keeps them: its records may be on their way already.
            if not isinstance(exc, asyncio.CancelledError):
                await self._unclaim(ids)
            raise

    async def _wait(self, ids: list[str], wait_s: float) -> dict[str, Result]:
        found: dict[str, Result] = {}
        try:
            async for result in self._client.wait_many(ids, wait_s):
                found[result.id] = result
        except ResultTimeout as exc:
            raise AnswerTimeout(exc.request_ids, wait_s) from None
        return found

    async def _redis_call(self, operation: Any) -> Any:
        try:
            return await operation
        except (RedisConnectionError, OSError, TimeoutError) as exc:
            raise ServiceUnavailable(
                f"cannot reach Redis at {self.settings.redis_location} ({exc})"
            ) from None
