"""Read results from a Redis Cluster: one read now, or wait for them without polling.

The algorithm of ``producers.waiting`` (subscribe, wait for the confirmation,
read, then read again what is announced), on sharded pub/sub: a worker's
result script announces a new result with ``SPUBLISH`` on the key's own shard
channel, so a wait subscribes (``SSUBSCRIBE``) to each key's channel on the
primary that serves the key, one connection per primary involved
(``producers.sharded_channels``), and reads
keys from the same primaries.

Sharded rather than classic pub/sub: a classic ``PUBLISH`` is copied to every
node over the cluster bus, and a copy lost with a dying primary is lost
silently; a sharded message never leaves its shard, so the only way to miss
one is to be subscribed somewhere else than the key's primary, which the
waiter can find out.

The rule that makes a wait miss nothing: each key is read from the very node
its channel is subscribed on, after Redis confirmed the subscription. That node
answers the read only while it is the key's primary (a replica answers
``MOVED``), so a read that succeeds proves the subscription sits where the
result will be announced. A subscription is moved, and its key read again,
when its node answers ``MOVED`` (to the node named), drops the channel (Redis
does when a slot moves away in a failover or a resharding) or drops the
connection (the node died), for up to ``connect_timeout_s`` while the cluster
fails over.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from redis.crc import key_slot
from redis.exceptions import MovedError, RedisError

from common.cluster_keys import per_key
from common.redis_cluster import ClusterRouter, Node, is_topology_error
from common.security import redis_options
from producers.errors import ServiceUnavailable
from producers.results import SENT_FIELD, RequestStatus, request_status, xread_entries
from producers.settings import ClientSettings
from producers.sharded_channels import ShardedChannels
from producers.waiting import wait_for_results
from schemas import Result, cancel_key, decode_result, result_key, status_key

T = TypeVar("T")


class ClusterResultReader:
    """Reads and waits for results in a Redis Cluster; the ``ResultReader`` of ``redis_cluster``."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._router = ClusterRouter(
            settings.redis_url.get_secret_value(),
            {
                "socket_connect_timeout": settings.connect_timeout_s,
                "socket_timeout": settings.connect_timeout_s,
                "client_name": settings.redis_client_name,
                **redis_options(settings),
            },
        )
        self._waits: set[ShardedChannels] = set()

    async def close(self) -> None:
        """Give back every connection, those of unfinished waits included."""
        for channels in list(self._waits):
            await channels.aclose()
        self._waits.clear()
        await self._router.aclose()

    async def get(self, request_id: str) -> Result | None:
        """The result now, or None while it is pending."""
        key = result_key(request_id)
        values = await self._read_raw([key])
        raw = values.get(key)
        return None if raw is None else decode_result(raw)

    async def status(self, request_id: str) -> RequestStatus:
        """Where the request stands now (``ResultReader.status``): the result key and
        the status hash, each read from its primary."""
        return await self._status(request_id, None)

    async def read_stream(
        self, key: str, last_id: str, block_ms: int, count: int
    ) -> list[tuple[str, Mapping[str, str]]]:
        """The entries of the stream ``key`` after ``last_id``: one ``XREAD`` on the
        primary of its slot (its key is hash-tagged with the request id), waiting up to
        ``block_ms`` for the first; a ``MOVED`` is followed."""

        async def attempt() -> Any:
            (node,) = await self._router.by_node([key])
            return await self._router.client(node).xread(
                {key: last_id}, count=count, block=block_ms
            )

        async def bounded() -> Any:
            async with asyncio.timeout(self._budget_s * 2 + block_ms / 1000):
                return await self._router.retrying(attempt, self._budget_s)

        return xread_entries(await self._errors(bounded()))

    async def cancel(self, request_id: str, ttl_s: int) -> RequestStatus:
        """Set the request's cancel key (kept ``ttl_s``); where it stood then."""
        return await self._status(request_id, ttl_s)

    async def _status(self, request_id: str, cancel_ttl_s: int | None) -> RequestStatus:
        result, status = result_key(request_id), status_key(request_id)
        keys = [result, status]
        if cancel_ttl_s is not None:
            keys.append(cancel_key(request_id))

        def command(pipe: Any, key: str) -> object:
            if key == result:
                return pipe.get(key)
            if key == status:
                return pipe.hgetall(key)
            return pipe.set(key, b"1", ex=cancel_ttl_s)

        async def bounded() -> dict[str, Any]:
            async with asyncio.timeout(self._budget_s * 2):
                return await per_key(self._router, keys, command, self._budget_s)

        answers = await self._errors(bounded())
        for answer in answers.values():
            if isinstance(answer, Exception):
                raise self._unavailable(str(answer))
        return request_status(
            request_id, answers[result], answers[status], self._settings.track_status
        )

    async def mark_sent(self, request_ids: Sequence[str], sent_ms: int, ttl_s: int) -> None:
        """Record that ``request_ids`` are being sent (``sent_ms`` in their status hashes):
        ``HSET`` on each key's primary, then ``EXPIRE``."""
        keys = [status_key(request_id) for request_id in request_ids]

        def hset(pipe: Any, key: str) -> object:
            return pipe.hset(key, SENT_FIELD, sent_ms)

        def expire(pipe: Any, key: str) -> object:
            return pipe.expire(key, ttl_s)

        async def bounded() -> None:
            async with asyncio.timeout(self._budget_s * 2):
                for command in (hset, expire):
                    answers = await per_key(self._router, keys, command, self._budget_s)
                    for answer in answers.values():
                        if isinstance(answer, Exception):
                            raise answer

        await self._errors(bounded())

    def wait_many(
        self,
        request_ids: Iterable[str],
        timeout: float,
    ) -> AsyncGenerator[Result, None]:
        """Yield each request's result as it becomes available, in completion order
        (``producers.waiting.wait_for_results``)."""
        return wait_for_results(_ClusterWait(self), request_ids, timeout)

    async def _read_subscribed(
        self, channels: ShardedChannels, keys: Collection[str]
    ) -> dict[str, bytes]:
        """Values of ``keys`` read from the nodes their channels are subscribed on.

        A node that is no longer the key's primary (``MOVED``) or no longer answers
        loses those subscriptions; ``channels.next`` moves them and has them read again.
        """
        plan: dict[Node, dict[int, list[str]]] = {}
        for key in keys:
            node = channels.node_of(key)
            if node is not None:  # else lost already: read once subscribed again
                plan.setdefault(node, {}).setdefault(key_slot(key.encode()), []).append(key)
        parts = await asyncio.gather(
            *(self._read_node(node, slots) for node, slots in plan.items()),
            return_exceptions=True,
        )
        found: dict[str, bytes] = {}
        for node, part in zip(plan, parts, strict=True):
            if isinstance(part, BaseException):
                if not is_topology_error(part):
                    raise part
                channels.drop(node)
                continue
            values, moved = part
            found.update(values)
            for error, lost in moved:
                self._router.moved(error)
                channels.lose(lost)
        return found

    async def _read_raw(self, keys: Collection[str]) -> dict[str, bytes]:
        """The values of ``keys`` that exist now, from the primaries of the slot map."""

        async def attempt() -> dict[str, bytes]:
            plan = await self._router.by_node(keys)
            parts = await asyncio.gather(*(self._read_node(n, s) for n, s in plan.items()))
            found: dict[str, bytes] = {}
            for values, moved in parts:
                if moved:
                    raise moved[0][0]  # the router follows it, and the attempt runs again
                found.update(values)
            return found

        async def bounded() -> dict[str, bytes]:
            async with asyncio.timeout(self._budget_s * 2):  # a node that hangs, not fails
                return await self._router.retrying(attempt, self._budget_s)

        return await self._errors(bounded())

    async def _read_node(
        self, node: Node, slots: dict[int, list[str]]
    ) -> tuple[dict[str, bytes], list[tuple[MovedError, list[str]]]]:
        """One pipeline to ``node``, one MGET per slot: the values found, and the slots'
        keys that ``node`` does not serve (with its ``MOVED`` answer)."""
        pipe = self._router.client(node).pipeline(transaction=False)
        groups = list(slots.values())
        for keys in groups:
            pipe.mget(keys)
        found: dict[str, bytes] = {}
        moved: list[tuple[MovedError, list[str]]] = []
        for keys, values in zip(groups, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(values, MovedError):
                moved.append((values, keys))
            elif isinstance(values, Exception):
                raise values
            else:
                found.update((k, v) for k, v in zip(keys, values, strict=True) if v is not None)
        return found, moved

    @property
    def _budget_s(self) -> float:
        return self._settings.connect_timeout_s

    async def _errors(self, operation: Awaitable[T]) -> T:
        """Turn a cluster that stays unreachable through a failover into ``ServiceUnavailable``."""
        try:
            return await operation
        except TimeoutError:
            raise self._unavailable(f"no answer in {self._budget_s * 2:g} s") from None
        except (RedisError, OSError) as exc:
            raise self._unavailable(str(exc) or type(exc).__name__) from exc

    def _unavailable(self, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"cannot reach the Redis Cluster at {self._settings.redis_location} ({why}): "
            "is it running (`make up-cluster`)? Point the client at one of its nodes with "
            "--redis-url or CONVEYOR_REDIS_URL, and check the CONVEYOR_REDIS_* security settings"
        )


class _ClusterWait:
    """One wait's ``producers.waiting.Subscription``: sharded channels of its own."""

    def __init__(self, reader: ClusterResultReader) -> None:
        self._reader = reader
        # Registered (for close()) when the wait starts: until then it holds nothing.
        self._channels = ShardedChannels(reader._router, reader._budget_s)

    async def subscribe(self, keys: Sequence[str]) -> None:
        self._reader._waits.add(self._channels)
        await self._reader._errors(self._channels.subscribe(keys))

    async def read(self, keys: Collection[str]) -> dict[str, bytes]:
        return await self._reader._errors(self._reader._read_subscribed(self._channels, keys))

    async def next(self, pending: Collection[str], deadline: float) -> Collection[str] | None:
        return await self._reader._errors(self._channels.next(pending, deadline))

    async def aclose(self) -> None:
        self._reader._waits.discard(self._channels)
        await self._channels.aclose()
