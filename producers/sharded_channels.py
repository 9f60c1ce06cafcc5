"""Sharded subscriptions of one wait on a Redis Cluster: one connection per primary involved.

``ClusterResultReader`` (``producers.cluster_results``) waits through these: each
key's channel is subscribed (``SSUBSCRIBE``) on the primary that serves the key,
and what Redis sends (announcements, confirmations, dropped channels, lost
connections) comes back as events on one queue. A subscription whose node drops
it or dies is subscribed again on the key's current primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from common.redis_cluster import ClusterRouter, Node

_DRAIN = 500  # events taken at once before the notified keys are read with one round trip


@dataclass(frozen=True, slots=True)
class _Event:
    """What one node's subscription connection reported."""

    kind: str  # "message", "confirmed", "moved" (Redis dropped the channel), "lost" (connection)
    node: Node
    source: PubSub  # the connection it came from: events of a replaced one are ignored
    channel: str | None = None


class ShardedChannels:
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
