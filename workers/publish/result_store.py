"""The result cache: the first final result of a request wins, one Redis call per batch.

``ResultStore`` is the port the publisher writes through. ``RedisResultStore``
is the standalone-Redis adapter: one Lua script per batch that, for every
result, does ``SET key value NX EX ttl`` and, when that created the key,
``PUBLISH key ""`` (the wake-up callers waiting on the id subscribe to); for a
key that already held an answer (a redelivered request) it returns the stored
bytes, so the reply topic can carry the very answer a caller may have read.

The script runs atomically, so "created, hence announced" and "existed, hence
returned" cannot interleave with another worker's write of the same id. It is
sent as ``EVALSHA``; after a Redis restart (``NOSCRIPT``) it is loaded again
and the call repeated. Repeating a batch that did run (a time-out after Redis
executed it) is safe too: the keys it created come back as existing, holding
the same bytes.

Before it writes anything, the script asks Redis (``redis.acl_check_cmd``, Redis
7.0 and later) whether its user may run each of its commands on each key of the
batch, and refuses the whole batch with a ``NOPERM`` error naming the first
command refused. Redis checks a script's commands only as it runs them, and does
not undo the writes before a refusal: without the check, a user without
``+publish`` (or without the channels) had the first result stored and never
announced, so a caller already waiting was never woken; the retry then found that
key written, stored the next one, and so on, until the batch "succeeded" with its
own first answers counted as duplicates. A user without ``+get`` served every new
id and failed only at the first redelivered one, maybe days later. Checked up
front, a missing grant fails the first batch, whole and at once, and the worker
names it (``workers.publish.errors``); nothing is written until it is granted.
(Publishing before the ``SET`` would spare the unannounced result, but not a batch
written part-way by a refused ``GET``, and would announce ids already answered.)
The check costs Redis about 0.4–0.8 µs per result, on a script of 3.5–4.5 µs per result
(``bench.redis_store``, docs/benchmarks.md).

The ACL a worker needs: ``+evalsha +script|load +set +get +publish`` on keys and
channels ``conveyor:result:*``, and ``+ping`` (docs/security.md). EVAL is never
sent: redis-py's ``Script`` loads the script with ``SCRIPT LOAD`` on ``NOSCRIPT``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as aioredis

from schemas import result_key

__all__ = ["GRANT_CHECK", "WRITE_FIRST_SCRIPT", "RedisResultStore", "ResultStore"]

GRANT_CHECK = """
local allowed = redis.acl_check_cmd
local announce = 'PUBLISH'
if allowed then
  for _, key in ipairs(KEYS) do
    if not allowed('SET', key, '', 'NX', 'EX', ARGV[1]) then
      return redis.error_reply('NOPERM this user may not SET ' .. key)
    end
    if not allowed('GET', key) then
      return redis.error_reply('NOPERM this user may not GET ' .. key)
    end
    if not allowed(announce, key, '') then
      -- Refused, so nothing is sent: Redis says why (the command, or the channel).
      local why = redis.pcall(announce, key, '')
      why = type(why) == 'table' and why.err or 'refused'
      return redis.error_reply('NOPERM this user may not ' .. announce .. ' ' .. key .. ': ' .. why)
    end
  end
end
"""
"""The first part of ``WRITE_FIRST_SCRIPT``: every grant of the batch, checked before
anything is written (see the module's docstring)."""

WRITE_FIRST_SCRIPT = (
    GRANT_CHECK
    + """
local ttl = ARGV[1]
local stored = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[i + 1], 'NX', 'EX', ttl) then
    redis.call('PUBLISH', key, '')
    stored[i] = false
  else
    stored[i] = redis.call('GET', key)
  end
end
return stored
"""
)
"""KEYS: result keys; ARGV[1]: TTL in seconds, ARGV[1 + i]: the value for KEYS[i].
Returns, per key, nil when this call wrote it, else the bytes stored before."""


class ResultStore(Protocol):
    """Where results become durable and visible to callers, first final result wins."""

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        """Store ``values[i]`` under request ``ids[i]`` unless a result is already there,
        and wake callers waiting on the ids written.

        Returns, per id, None when this call stored it, else the bytes stored earlier.
        Raises the client's errors (``redis.exceptions.RedisError``, ``OSError``); the
        caller decides which are worth retrying.
        """

    async def ping(self) -> bool:
        """Whether the store answers now."""

    async def aclose(self) -> None:
        """Give back every connection."""


class RedisResultStore:
    """``ResultStore`` on one standalone Redis server (or a primary behind a proxy)."""

    def __init__(self, client: aioredis.Redis, ttl_s: int) -> None:
        self._redis = client
        self._ttl_s = ttl_s
        # redis-py's Script sends EVALSHA and, on NOSCRIPT, loads the script and retries.
        self._script = client.register_script(WRITE_FIRST_SCRIPT)

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} ids but {len(values)} values; need one each")
        if not ids:
            return []
        keys = [result_key(request_id) for request_id in ids]
        stored = await self._script(keys=keys, args=[self._ttl_s, *values])
        return [value if isinstance(value, bytes) else None for value in stored]

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def aclose(self) -> None:
        await self._redis.aclose()
