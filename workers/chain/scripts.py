"""The joins' Redis scripts, run on one server or on a Redis Cluster.

A script call of the joins carries many items (parents, or child answers), each with its
keys and arguments, and answers one value an item. On one server it is one call. On a
Redis Cluster a script may touch keys of one hash slot only: there each item's keys share
a slot (a join's key carries a hash tag that puts it in its parent's result key's slot,
``schemas.chain.join_key``), the items are grouped by slot, and each primary gets one
pipeline with one call per slot, the primaries at once, as the result store writes
results (``workers.publish.cluster_store``). The scripts are written so that running an
item twice changes nothing: a call that fails part-way is repeated whole.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from functools import cache
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from common.redis_cluster import ClusterRouter, Node
from schemas.chain import hash_slot

PARENT_SCRIPT = """
local ttl = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local join, result = KEYS[2 * i - 1], KEYS[2 * i]
  local a = 1 + 7 * (i - 1)
  if redis.call('EXISTS', result) == 1 then
    out[i] = {2}
  elseif redis.call('HSETNX', join, 'doc', ARGV[a + 1]) == 1 then
    redis.call('HSET', join, 'count', ARGV[a + 2], 'boxes', ARGV[a + 3], 'reply', ARGV[a + 4],
               'trace', ARGV[a + 5], 'next', ARGV[a + 6], 'up', ARGV[a + 7])
    redis.call('EXPIRE', join, ttl)
    out[i] = {0}
  else
    out[i] = {1, redis.call('HGET', join, 'doc')}
  end
end
return out
"""
"""KEYS: per parent its join and its result key. ARGV[1]: the TTL; then per parent its
document, child count, detection indices (JSON), reply topic, trace context, next model,
and, for a parent that is itself a child, its place in its own parent's join (JSON).
Returns per parent {0} (this call started the join), {1, document} (a join was there:
its document) or {2} (the parent's result is written)."""

CHILD_SCRIPT = """
local out = {}
for i, join in ipairs(KEYS) do
  local count = redis.call('HGET', join, 'count')
  local a = 3 * (i - 1)
  if count ~= ARGV[a + 1] or tonumber(ARGV[a + 2]) >= tonumber(count) then
    out[i] = -1
  else
    redis.call('HSETNX', join, 'c' .. ARGV[a + 2], ARGV[a + 3])
    if redis.call('HLEN', join) - 7 >= tonumber(count) then
      out[i] = redis.call('HGETALL', join)
    else
      out[i] = 0
    end
  end
end
return out
"""
"""KEYS: the join of each child answer; ARGV: per child its parent's child count, its
index and its document. Returns per child -1 (no such join, as after it expired, or one
whose count or indices the child does not fit), 0 (children still missing) or every
field of the complete join."""

DEADLINE_SCRIPT = """
local out = {}
for i = 1, #KEYS / 2 do
  local join, result = KEYS[2 * i - 1], KEYS[2 * i]
  local count = redis.call('HGET', join, 'count')
  if redis.call('EXISTS', result) == 1 or not count
     or redis.call('HLEN', join) - 7 >= tonumber(count) then
    out[i] = 0
  else
    out[i] = redis.call('HGETALL', join)
  end
end
return out
"""
"""KEYS: per parent its join and its result key. Returns per parent every field of its
join when it has no result yet and children are missing, else 0."""

Item = tuple[Sequence[str], Sequence[Any]]
"""One item of a script call: its keys and its arguments."""


class Scripts(Protocol):
    """Runs the joins' scripts where the results are kept."""

    cluster: bool  # whether join keys take their result key's slot (``join_key``)

    async def each(
        self, script: str, items: Sequence[Item], first: Sequence[Any] = ()
    ) -> list[Any]:
        """``script``'s answer for each of ``items``, in order; ``first``: arguments ahead
        of every item's (the script reads them as ``ARGV[1]``...)."""
        ...

    async def aclose(self) -> None: ...


class OneServer:
    """``Scripts`` on one Redis server: one call for all the items."""

    cluster = False

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._registered: dict[str, Any] = {}

    async def each(
        self, script: str, items: Sequence[Item], first: Sequence[Any] = ()
    ) -> list[Any]:
        call = self._registered.get(script)
        if call is None:
            call = self._registered[script] = self._client.register_script(script)
        keys = [key for item_keys, _ in items for key in item_keys]
        args = [*first, *(arg for _, item_args in items for arg in item_args)]
        return list(await call(keys=keys, args=args))

    async def aclose(self) -> None:
        await self._client.aclose()


class OnCluster:
    """``Scripts`` on a Redis Cluster: one call a slot, one pipeline a primary."""

    cluster = True

    def __init__(self, router: ClusterRouter) -> None:
        self._router = router

    async def each(
        self, script: str, items: Sequence[Item], first: Sequence[Any] = ()
    ) -> list[Any]:
        slots: dict[int, list[int]] = {}
        for n, (keys, _) in enumerate(items):
            slot = {hash_slot(key) for key in keys}
            if len(slot) != 1:
                raise ValueError(f"a script's item must keep to one hash slot: {list(keys)}")
            slots.setdefault(slot.pop(), []).append(n)
        plan = await self._router.by_node(items[numbers[0]][0][0] for numbers in slots.values())
        parts = await asyncio.gather(
            *(
                self._on(node, script, [slots[slot] for slot in on_node], items, first)
                for node, on_node in plan.items()
            ),
            return_exceptions=True,
        )
        answers: list[Any] = [None] * len(items)
        for part in self._router.learned(parts):
            for n, answer in part:
                answers[n] = answer
        return answers

    async def _on(
        self,
        node: Node,
        script: str,
        groups: list[list[int]],
        items: Sequence[Item],
        first: Sequence[Any],
    ) -> list[tuple[int, Any]]:
        """Each group's call on ``node``, in one pipeline: (item number, answer) pairs."""
        client = self._router.client(node)
        sha = _sha(script)
        replies = await self._pipeline(client, sha, groups, items, first)
        if any(isinstance(reply, NoScriptError) for reply in replies):
            # A restarted or newly promoted node has an empty script cache; the groups
            # that ran already change nothing when run again.
            await client.script_load(script)
            replies = await self._pipeline(client, sha, groups, items, first)
        answered: list[tuple[int, Any]] = []
        for numbers, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            answered += zip(numbers, reply, strict=True)
        return answered

    @staticmethod
    async def _pipeline(
        client: aioredis.Redis,
        sha: str,
        groups: list[list[int]],
        items: Sequence[Item],
        first: Sequence[Any],
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for numbers in groups:
            keys = [key for n in numbers for key in items[n][0]]
            args = [*first, *(arg for n in numbers for arg in items[n][1])]
            pipe.evalsha(sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def aclose(self) -> None:
        await self._router.aclose()


@cache
def _sha(script: str) -> str:
    """The SHA-1 by which Redis knows ``script`` (``EVALSHA``)."""
    return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()
