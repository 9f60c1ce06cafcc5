"""The result cache on a Redis Cluster, and the factory that picks the store from settings.

``RedisClusterResultStore`` keeps the contract of ``workers.publish.result_store``: first final
result wins, stored bytes come back for ids already answered, callers waiting
on an id are woken. A batch's keys are grouped by hash slot (a Lua script may
only touch keys of one slot) and by the primary serving the slot; each primary
gets one pipeline with one script call per slot, and the primaries are written
concurrently. Keys keep the contract's ``conveyor:result:<id>`` (no hash tag),
so a batch of n results is about n script calls spread over the primaries: more
server work than the single call of a standalone Redis, the same number of
round trips per node.

Two differences from the standalone store:

- The wake-up is ``SPUBLISH`` on the key's shard channel (sharded pub/sub): it
  stays on the shard that owns the key instead of crossing the whole cluster
  bus, and a caller subscribed on that shard learns of a failover by losing its
  connection there (``producers.cluster_results``).
- With ``redis_replica_acks`` = n > 0, each pipeline ends with ``WAIT n``: the
  batch counts as written only once n replicas of every primary involved hold
  it, so a primary that dies after answering cannot take an acknowledged result
  with it (replication is asynchronous). Too few acknowledgements raise
  ``ReplicasBehind``, which the publisher retries like an outage.

A batch is not atomic across primaries: one may fail after another wrote its
part. The publisher then retries the batch; keys it already wrote hold exactly
the bytes being written, and count as written by this call, not as answers of
an earlier delivery.

The ACL a worker needs: ``+evalsha +eval +script|load +set +get +spublish +wait
+ping +cluster|slots`` on keys and channels ``conveyor:result:*``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from common.redis_cluster import ClusterRouter, Node
from common.security import redis_options
from schemas import result_key
from workers.config.worker import WorkerSettings
from workers.publish.result_store import WRITE_FIRST_SCRIPT, RedisResultStore, ResultStore

__all__ = [
    "CLUSTER_WRITE_FIRST_SCRIPT",
    "RedisClusterResultStore",
    "ReplicasBehind",
    "open_result_store",
]

CLUSTER_WRITE_FIRST_SCRIPT = WRITE_FIRST_SCRIPT.replace("'PUBLISH'", "'SPUBLISH'")
"""``workers.publish.result_store.WRITE_FIRST_SCRIPT`` with the wake-up on the key's shard channel
(``SPUBLISH``); KEYS must share one hash slot."""
_SCRIPT_SHA = hashlib.sha1(CLUSTER_WRITE_FIRST_SCRIPT.encode(), usedforsecurity=False).hexdigest()

_WAIT_TIMEOUT_MS = 2_000  # a replica that is connected acknowledges in milliseconds
_SOCKET_TIMEOUT_S = 10.0  # above _WAIT_TIMEOUT_MS: a slow WAIT is not a dead connection
_CONNECT_TIMEOUT_S = 5.0


class ReplicasBehind(RedisError):
    """Fewer replicas than ``redis_replica_acks`` acknowledged a batch in time."""


class RedisClusterResultStore:
    """``ResultStore`` on a Redis Cluster: one pipeline per primary, one script call per slot."""

    def __init__(self, router: ClusterRouter, ttl_s: int, replica_acks: int = 0) -> None:
        self._router = router
        self._ttl_s = ttl_s
        self._replica_acks = replica_acks

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} ids but {len(values)} values; need one each")
        if not ids:
            return []
        value_of = {result_key(i): v for i, v in zip(ids, values, strict=True)}
        plan = await self._router.by_node(value_of)
        # Every primary's part runs to its end before an error is raised, so no write
        # of this call is still in flight when the publisher tries the batch again.
        parts = await asyncio.gather(
            *(self._write_node(node, slots, value_of) for node, slots in plan.items()),
            return_exceptions=True,
        )
        stored: dict[str, bytes | None] = {}
        for part in self._router.learned(parts):
            stored.update(part)
        return [stored[result_key(i)] for i in ids]

    async def _write_node(
        self, node: Node, slots: dict[int, list[str]], value_of: dict[str, bytes]
    ) -> dict[str, bytes | None]:
        """Run the script once per slot on ``node``, then WAIT; what each key holds now."""
        client = self._router.client(node)
        groups = list(slots.values())
        replies = await self._pipeline(client, groups, value_of)
        if any(isinstance(reply, NoScriptError) for reply in replies[: len(groups)]):
            # A restarted or newly promoted node has an empty script cache. Nothing
            # ran for the groups that got NOSCRIPT; those that ran are idempotent.
            await client.script_load(CLUSTER_WRITE_FIRST_SCRIPT)
            replies = await self._pipeline(client, groups, value_of)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if self._replica_acks and int(replies[-1]) < self._replica_acks:
            raise ReplicasBehind(
                f"{replies[-1]} of {self._replica_acks} replicas of Redis node {node} "
                f"acknowledged the batch in {_WAIT_TIMEOUT_MS} ms"
            )
        stored: dict[str, bytes | None] = {}
        for keys, reply in zip(groups, replies, strict=False):
            for key, before in zip(keys, reply, strict=True):
                # Exactly our bytes: an earlier try of this very batch wrote them.
                mine = before is None or before == value_of[key]
                stored[key] = None if mine else bytes(before)
        return stored

    async def _pipeline(
        self, client: aioredis.Redis, groups: list[list[str]], value_of: dict[str, bytes]
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for keys in groups:
            pipe.evalsha(_SCRIPT_SHA, len(keys), *keys, self._ttl_s, *(value_of[k] for k in keys))
        if self._replica_acks:
            pipe.execute_command("WAIT", self._replica_acks, _WAIT_TIMEOUT_MS)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def ping(self) -> bool:
        """Whether every primary answers (a batch's keys reach all of them)."""
        nodes = await self._router.primaries()
        answers = await asyncio.gather(*(self._router.client(n).ping() for n in nodes))
        return all(answers)

    async def aclose(self) -> None:
        await self._router.aclose()


def open_result_store(settings: WorkerSettings) -> ResultStore:
    """The result store ``settings`` ask for: a Redis Cluster (``redis_cluster``) or one
    standalone server. Connects lazily; ``ping()`` it to find out whether Redis answers."""
    url = settings.redis_url.get_secret_value()
    options: dict[str, Any] = {
        "socket_timeout": _SOCKET_TIMEOUT_S,
        "socket_connect_timeout": _CONNECT_TIMEOUT_S,
        **redis_options(settings),
    }
    if settings.redis_cluster:
        router = ClusterRouter(url, options)
        return RedisClusterResultStore(router, settings.result_ttl_s, settings.redis_replica_acks)
    return RedisResultStore(aioredis.Redis.from_url(url, **options), settings.result_ttl_s)
