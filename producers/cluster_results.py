"""Read results from a Redis Cluster: one read now, or wait for them without polling.

The algorithm of ``producers.results`` (subscribe, wait for the confirmation,
read, then read again what is announced), on sharded pub/sub: a worker's
result script announces a new result with ``SPUBLISH`` on the key's own shard
channel, so a wait subscribes (``SSUBSCRIBE``) to each key's channel on the
primary that serves the key, one connection per primary involved, and reads
keys from the same primaries.

Sharded rather than classic pub/sub: a classic ``PUBLISH`` is copied to every
node over the cluster bus, and a copy lost with a dying primary is lost
silently; a sharded message never leaves its shard, so the only way to miss
one is to lose the connection to that shard, which the waiter sees. When that
happens (the primary died, or Redis dropped the channel because its slot moved
elsewhere), the wait refreshes the slot map, subscribes to the affected
channels on their new primaries, and reads those keys again, for up to
``connect_timeout_s`` while the cluster fails over. Nothing is missed: every
key is read after its channel's subscription on its current primary is
confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from producers.errors import ResultTimeout, ServiceUnavailable
from producers.redis_cluster import ClusterRouter, Node
from producers.security import redis_options
from producers.settings import ClientSettings
from schemas import Result, decode_result, result_key

T = TypeVar("T")
_DRAIN = 500  # events taken at once before the notified keys are read with one round trip


@dataclass(frozen=True, slots=True)
class _Event:
    """What one node's subscription connection reported."""

    kind: str  # "message", "confirmed", "moved" (Redis dropped the channel), "lost" (connection)
    node: Node
    source: PubSub  # the connection it came from: events of a replaced one are ignored
    channel: str | None = None


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
        self._waits: set[_ShardedChannels] = set()

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
        channels = _ShardedChannels(self._router, self._budget_s)
        self._waits.add(channels)
        try:
            await self._with_failover(channels.subscribe(list(pending)))
            to_read: Collection[str] = list(pending)
            while pending:
                values = await self._read_raw(to_read)
                for key in to_read:
                    raw = values.get(key)
                    if raw is not None and key in pending:
                        del pending[key]
                        yield decode_result(raw)
                if not pending:
                    return
                to_read = await self._with_failover(channels.next(pending, deadline))
                if not to_read:
                    raise ResultTimeout(list(pending.values()), timeout)
        finally:
            self._waits.discard(channels)
            await channels.aclose()

    async def _read_raw(self, keys: Collection[str]) -> dict[str, bytes]:
        """The values of ``keys`` that exist now: one pipeline per primary, one MGET per slot."""

        async def attempt() -> dict[str, bytes]:
            plan = await self._router.by_node(keys)
            parts = await asyncio.gather(*(self._read_node(n, s) for n, s in plan.items()))
            return {key: value for part in parts for key, value in part.items()}

        return await self._with_failover(self._router.retrying(attempt, self._budget_s))

    async def _read_node(self, node: Node, slots: dict[int, list[str]]) -> dict[str, bytes]:
        pipe = self._router.client(node).pipeline(transaction=False)
        groups = list(slots.values())
        for keys in groups:
            pipe.mget(keys)
        found: dict[str, bytes] = {}
        for keys, values in zip(groups, await pipe.execute(), strict=True):
            found.update((k, v) for k, v in zip(keys, values, strict=True) if v is not None)
        return found

    @property
    def _budget_s(self) -> float:
        return self._settings.connect_timeout_s

    async def _with_failover(self, operation: Awaitable[T]) -> T:
        """Turn a cluster that stays unreachable into ``ServiceUnavailable``."""
        try:
            async with asyncio.timeout(self._budget_s * 2):
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


class _ShardedChannels:
    """Sharded subscriptions of one wait, one connection per primary involved.

    A task per connection turns what Redis sends into ``_Event``s on one queue, which
    the wait consumes. A connection that fails ends its task with a "lost" event, and
    every channel it held is subscribed again on its current primary (and its key
    read again).
    """

    def __init__(self, router: ClusterRouter, budget_s: float) -> None:
        self._router = router
        self._budget_s = budget_s  # how long to follow a failover before giving up
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._pubsubs: dict[Node, PubSub] = {}
        self._tasks: dict[Node, asyncio.Task[None]] = {}
        self._dead: list[PubSub] = []  # connections that failed, closed at the end
        self._held: dict[str, Node] = {}  # channel -> the node it is subscribed on
        self._notified: set[str] = set()
        self._lost: set[str] = set()  # to subscribe again, and whose keys to read again

    async def subscribe(self, channels: Collection[str]) -> None:
        """Subscribe to ``channels`` on the primaries serving them; return once Redis
        confirmed each one. Follows a failover for up to the budget."""
        todo = set(channels)

        async def attempt() -> None:
            self._lost -= todo  # subscribed again right now
            for node, slots in (await self._router.by_node(todo)).items():
                try:
                    await self._send(node, slots)
                except (RedisError, OSError):
                    self._drop(self._pubsubs.get(node), node)
                    raise
            while todo:
                self._take(await self._events.get(), todo)
                if self._lost & todo:
                    raise _NodeLost("a subscription connection failed while subscribing")

        await self._router.retrying(attempt, self._budget_s)

    async def next(self, pending: Collection[str], deadline: float) -> list[str]:
        """Pending channels to read now: announced ones, and those subscribed again after
        their node was lost. Waits until ``deadline`` for one; empty once it passed."""
        while True:
            if self._lost:
                again = {c for c in self._lost if c in pending}
                self._lost.clear()
                await self.subscribe(again)
                ready = again | {c for c in self._notified if c in pending}
                self._notified.clear()
                return list(ready)
            ready_now = [c for c in self._notified if c in pending]
            self._notified.clear()
            if ready_now:
                return ready_now
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                event = await asyncio.wait_for(self._events.get(), remaining)
            except TimeoutError:
                return []
            self._take(event, set())
            for _ in range(_DRAIN):  # take whatever else arrived: a burst costs one read
                if self._events.empty():
                    break
                self._take(self._events.get_nowait(), set())

    def _take(self, event: _Event, todo: set[str]) -> None:
        """Apply one event; ``todo`` holds the channels whose confirmation is awaited."""
        if self._pubsubs.get(event.node) is not event.source:
            return  # from a connection already given up
        if event.kind == "lost":
            self._drop(event.source, event.node)
            return
        channel = event.channel
        if channel is None or self._held.get(channel) != event.node:
            return
        if event.kind == "message":
            self._notified.add(channel)
        elif event.kind == "confirmed":
            todo.discard(channel)
        elif event.kind == "moved":  # Redis dropped it: its slot is served elsewhere now
            del self._held[channel]
            self._lost.add(channel)
            self._router.mark_stale()

    async def _send(self, node: Node, slots: dict[int, list[str]]) -> None:
        """SSUBSCRIBE each slot's channels on ``node``; confirmations arrive as events."""
        pubsub = self._pubsubs.get(node)
        if pubsub is None:
            pubsub = self._pubsubs[node] = self._router.client(node).pubsub()
        for channels in slots.values():
            self._held.update(dict.fromkeys(channels, node))
            await pubsub.ssubscribe(*channels)  # one slot per command: cross-slot is refused
        if node not in self._tasks:  # connected now, so it can be listened to
            self._tasks[node] = asyncio.create_task(self._listen(node, pubsub))

    async def _listen(self, node: Node, pubsub: PubSub) -> None:
        kinds = {"smessage": "message", "ssubscribe": "confirmed", "sunsubscribe": "moved"}
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is not None and message["type"] in kinds:
                    channel = _text(message["channel"])
                    self._events.put_nowait(_Event(kinds[message["type"]], node, pubsub, channel))
        except (RedisError, OSError):
            # The node died, or refused a channel of a slot it does not serve (MOVED).
            self._events.put_nowait(_Event("lost", node, pubsub))

    def _drop(self, pubsub: PubSub | None, node: Node) -> None:
        """Give up ``node``'s connection; every channel it held is lost."""
        self._router.mark_stale()
        for channel, held_on in list(self._held.items()):
            if held_on == node:
                del self._held[channel]
                self._lost.add(channel)
        self._tasks.pop(node, None)  # ended, or ends on its own error
        if pubsub is not None and self._pubsubs.get(node) is pubsub:
            del self._pubsubs[node]
            self._dead.append(pubsub)

    async def aclose(self) -> None:
        """Stop listening and close every subscription connection."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for pubsub in [*self._pubsubs.values(), *self._dead]:
            await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
        self._pubsubs.clear()
        self._dead.clear()


class _NodeLost(RedisConnectionError):
    """A subscription connection failed while subscribing: its channels go elsewhere."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
