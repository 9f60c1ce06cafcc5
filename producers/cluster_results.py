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
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio.client import PubSub
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, RedisError

from common.cluster_keys import per_key
from common.redis_cluster import ClusterRouter, Node, is_topology_error
from common.security import redis_options
from producers.errors import ResultTimeout, ServiceUnavailable
from producers.results import RequestStatus, request_status
from producers.settings import ClientSettings
from schemas import Result, cancel_key, decode_result, result_key, status_key

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

    async def status(self, request_id: str) -> RequestStatus:
        """Where the request stands now (``ResultReader.status``): the result key and
        the status hash, each read from its primary."""
        return await self._status(request_id, None)

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
        return request_status(request_id, answers[result], answers[status])

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
            await self._errors(channels.subscribe(list(pending)))
            to_read: Collection[str] | None = list(pending)
            while to_read is not None:
                values = await self._errors(self._read_subscribed(channels, to_read))
                for key, raw in values.items():
                    if key in pending:
                        del pending[key]
                        yield decode_result(raw)
                if not pending:
                    return
                to_read = await self._errors(channels.next(pending, deadline))
            raise ResultTimeout(list(pending.values()), timeout)
        finally:
            self._waits.discard(channels)
            await channels.aclose()

    async def _read_subscribed(
        self, channels: _ShardedChannels, keys: Collection[str]
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
                    self.drop(node)
                    raise
            while todo:
                self._take(await self._events.get(), todo)
                if self._lost & todo:
                    raise _NodeLost("a subscription connection failed while subscribing")

        async with asyncio.timeout(self._budget_s * 2):  # a node that hangs, not fails
            await self._router.retrying(attempt, self._budget_s)

    async def next(self, pending: Collection[str], deadline: float) -> list[str] | None:
        """Pending channels to read now: announced ones, and those subscribed again after
        their node was lost. Waits until ``deadline`` for one; None once it passed."""
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
                return None
            try:
                event = await asyncio.wait_for(self._events.get(), remaining)
            except TimeoutError:
                return None
            self._take(event, set())
            for _ in range(_DRAIN):  # take whatever else arrived: a burst costs one read
                if self._events.empty():
                    break
                self._take(self._events.get_nowait(), set())

    def node_of(self, channel: str) -> Node | None:
        """The node ``channel`` is subscribed on (confirmed, or awaiting confirmation)."""
        return self._held.get(channel)

    def lose(self, channels: Iterable[str]) -> None:
        """These subscriptions sit on a node that does not serve their keys: move them."""
        for channel in channels:
            self._held.pop(channel, None)
            self._lost.add(channel)

    def drop(self, node: Node) -> None:
        """``node`` no longer answers: every subscription on it moves."""
        self._drop(self._pubsubs.get(node), node)

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
