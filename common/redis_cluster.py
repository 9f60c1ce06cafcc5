"""Redis Cluster routing for the result cache: which primary holds a key, and a client per node.

The result cache needs two things from a cluster that redis-py's cluster client
does not offer: a batch's writes and the ``WAIT`` after them sent on one
connection of one node (``WAIT`` counts the replicas that acknowledged *that
connection's* writes), and sharded subscriptions that fail loudly, per node,
when their node goes away. So ``ClusterRouter`` keeps the slot map itself
(``CLUSTER SLOTS`` from any node that answers) and one ordinary
``redis.asyncio.Redis`` client per node, with redis-py's own retries off: a
caller groups its keys by node (``by_node``) and talks to each node directly.
A ``MOVED`` answer names the slot's new primary, which is believed at once
(``moved``), as cluster clients do: a freshly loaded map may come from a node
that has not heard of a failover yet. After ``CLUSTERDOWN`` or a lost
connection the map is loaded again (``mark_stale``). ``retrying`` does both
around an attempt, for callers without a retry loop of their own.

Keys stay ``conveyor:result:<id>``, without a hash tag: the contract lets any
client find a result by id alone, and ids spread evenly over the slots. The
cost is that a batch's keys fall in as many slots as it has results, so a batch
is one script call per slot, sent to each primary as one pipeline.

Nodes are reached at the address they announce (``cluster-announce-ip`` /
``cluster-announce-hostname``), with the scheme, credentials and TLS files of
the configured URL. Redis Cluster has one database, 0.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MovedError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "ClusterRouter",
    "Node",
    "check_cluster_url",
    "is_topology_error",
]

T = TypeVar("T")

SLOTS = 16384
_TOPOLOGY_ERRORS: tuple[type[Exception], ...] = (
    AskError,  # and MovedError, its subclass: the slot is served elsewhere (now, or soon)
    ClusterDownError,  # a primary failed and no replica took over yet
    TryAgainError,  # a multi-key command hit a slot in the middle of a migration
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
)
"""Errors that a fresh slot map and another try may cure."""

_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 1.0


class Node(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def is_topology_error(exc: BaseException) -> bool:
    """Whether ``exc`` may pass once the cluster settles (not refused credentials)."""
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return False
    return isinstance(exc, _TOPOLOGY_ERRORS)


def check_cluster_url(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` can name a Redis Cluster node (redis[s]://, db 0)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(
            f"a Redis Cluster is reached over TCP: redis_url must be redis:// or rediss://, "
            f"not {parts.scheme}://"
        )
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(
            f"Redis Cluster has only database 0; redis_url names database {parts.path.strip('/')}"
        )


class ClusterRouter:
    """The slot map of one Redis Cluster and a client per node, refreshed on demand."""

    def __init__(self, url: str, client_options: dict[str, Any]) -> None:
        """``url``: any node of the cluster (the seed); ``client_options``: keyword
        arguments for every node's ``redis.asyncio.Redis.from_url`` (timeouts, TLS, auth)."""
        check_cluster_url(url)
        parts = urlsplit(url)
        self._parts = parts
        self._seed = Node(parts.hostname or "127.0.0.1", parts.port or 6379)
        # Retries are this module's job: redis-py's own would reconnect to a dead node.
        self._options = {**client_options, "retry": Retry(NoBackoff(), 0)}
        self._clients: dict[Node, aioredis.Redis] = {}
        self._starts: list[int] = []  # first slot of each range, sorted
        self._ranges: list[tuple[int, int, Node]] = []  # (first, last, primary)
        self._known: list[Node] = []  # every node of the last map, primaries first
        self._answered: Node | None = None  # the node that gave the last map: asked first
        self._moved: dict[int, Node] = {}  # slot -> primary named by a MOVED since the last load
        self._stale = True
        self._refreshing = asyncio.Lock()

    def client(self, node: Node) -> aioredis.Redis:
        """The client of ``node`` (made on first use, closed by ``aclose``)."""
        client = self._clients.get(node)
        if client is None:
            netloc = f"{node.host}:{node.port}"
            if self._parts.username or self._parts.password:
                netloc = f"{self._parts.netloc.rpartition('@')[0]}@{netloc}"
            url = urlunsplit((self._parts.scheme, netloc, "/0", self._parts.query, ""))
            client = self._clients[node] = aioredis.Redis.from_url(url, **self._options)
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    def mark_stale(self) -> None:
        """Load the slot map again before the next routing (after a lost node)."""
        self._stale = True

    def moved(self, error: MovedError) -> None:
        """Route ``error``'s slot to the primary it names from now on."""
        self._moved[error.slot_id] = Node(error.host, error.port)

    async def by_node(self, keys: Iterable[str]) -> dict[Node, dict[int, list[str]]]:
        """``keys`` grouped by the primary that serves them, then by hash slot. When the
        map cannot be loaded, or a slot has no primary in it, it stays stale: the next
        call loads it again."""
        if self._stale:
            await self.refresh()
        plan: dict[Node, dict[int, list[str]]] = {}
        for key in keys:
            slot = key_slot(key.encode())
            plan.setdefault(self._owner(slot), {}).setdefault(slot, []).append(key)
        return plan

    async def primaries(self) -> list[Node]:
        if self._stale:
            await self.refresh()
        return list(dict.fromkeys(node for _, _, node in self._ranges))

    def _owner(self, slot: int) -> Node:
        moved = self._moved.get(slot)
        if moved is not None:
            return moved
        index = bisect.bisect_right(self._starts, slot) - 1
        if index >= 0:
            first, last, node = self._ranges[index]
            if first <= slot <= last:
                return node
        self._stale = True
        raise ClusterDownError(f"CLUSTERDOWN hash slot {slot} is not served by any node")

    async def refresh(self) -> None:
        """Load the slot map from the first node that answers ``CLUSTER SLOTS``.

        Raises ``redis.exceptions.ConnectionError`` naming the nodes tried when none does.
        """
        async with self._refreshing:
            tried: list[str] = []
            # The last node that answered first: a dead primary, still in the map, may
            # take a whole connect timeout to fail.
            first = [self._answered] if self._answered is not None else []
            for node in dict.fromkeys([*first, *self._known, self._seed]):
                try:
                    answer = await self.client(node).cluster("SLOTS")
                except (RedisError, OSError) as exc:
                    if not is_topology_error(exc):
                        raise
                    tried.append(f"{node} ({exc})")
                    continue
                self._load(answer, node)
                self._answered = node
                return
            raise RedisConnectionError(
                f"no node of the Redis Cluster answered CLUSTER SLOTS: {'; '.join(tried)}"
            )

    def _load(self, answer: Sequence[Any], asked: Node) -> None:
        ranges: list[tuple[int, int, Node]] = []
        known: list[Node] = []
        for first, last, *nodes in answer:
            members = [_node(entry, asked) for entry in nodes]
            ranges.append((int(first), int(last), members[0]))
            known.extend(members)
        ranges.sort()
        self._ranges = ranges
        self._starts = [first for first, _, _ in ranges]
        primaries = [node for _, _, node in ranges]
        self._known = list(dict.fromkeys([*primaries, *known]))
        self._moved = {}
        self._stale = False

    def learned(self, parts: Sequence[T | BaseException]) -> list[T]:
        """The answers of a call sent to several primaries at once (``asyncio.gather``
        with ``return_exceptions``), once every part has run: what its errors teach is
        learnt first (a ``MOVED`` names the slot's new primary, a lost node has the map
        loaded again), then the first error is raised, so that no part of the call is
        still in flight when the caller tries it again."""
        for part in parts:
            if isinstance(part, MovedError):
                self.moved(part)  # a failover or a resharding: the new route
            elif isinstance(part, BaseException) and is_topology_error(part):
                self.mark_stale()  # a node lost: load the map again
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return [part for part in parts if not isinstance(part, BaseException)]

    async def retrying(self, attempt: Callable[[], Awaitable[T]], budget_s: float) -> T:
        """Run ``attempt`` until it passes: after a ``MOVED`` at once, along the new route;
        after another topology error once the map is loaded again, backing off. For up to
        ``budget_s`` seconds; then the last error is raised."""
        deadline = time.monotonic() + budget_s
        delay = _BACKOFF_START_S
        while True:
            try:
                return await attempt()
            except MovedError as exc:
                if time.monotonic() > deadline:
                    raise
                self.moved(exc)
                continue
            except (RedisError, OSError) as exc:
                if not is_topology_error(exc) or time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
            try:
                await self.refresh()
            except RedisConnectionError:
                self._stale = True  # every node down for now: try again after the next pause


def _node(entry: Sequence[Any], asked: Node) -> Node:
    """A node of a ``CLUSTER SLOTS`` range: ``[ip, port, id, ...]``. An empty address
    means "the node you asked" (a node that does not know its own address)."""
    host = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0])
    return Node(host or asked.host, int(entry[1]))
