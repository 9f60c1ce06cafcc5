"""Results seen from outside a worker: read, count, wait for and tally what reached Redis.

A Redis Cluster is named by a ``redis+cluster://host:port/0`` URL (any node): it
is read with redis-py's own cluster client, an implementation independent of
Conveyor's. ``tally`` counts a run's produced, answered, lost, duplicate-visible
and redelivered requests from Redis and the reply topic.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from producers.testing.kafka import Isolation, read_topic
from producers.testing.processes import is_cluster, plain_url
from schemas import Result, decode_result, result_key

RedisReader = aioredis.Redis | RedisCluster
_CHUNK = 1000  # keys per MGET or pipeline


@asynccontextmanager
async def redis_reader(redis_url: str) -> AsyncIterator[RedisReader]:
    """A redis-py client for ``redis_url``: a cluster client for a ``redis+cluster`` URL."""
    client: RedisReader = (
        RedisCluster.from_url(plain_url(redis_url))
        if is_cluster(redis_url)
        else aioredis.Redis.from_url(redis_url)
    )
    try:
        yield client
    finally:
        await client.aclose()


async def _values(client: RedisReader, ids: Sequence[str]) -> list[bytes | None]:
    """The stored result documents of ``ids``, in order (None: no result yet)."""
    values: list[bytes | None] = []
    for start in range(0, len(ids), _CHUNK):
        keys = [result_key(i) for i in ids[start : start + _CHUNK]]
        if isinstance(client, RedisCluster):
            got = await client.mget_nonatomic(keys)
        else:
            got = await client.mget(keys)
        # str only with decode_responses, which these clients leave off.
        values += [v.encode() if isinstance(v, str) else v for v in got]
    return values


async def read_results(redis_url: str, ids: Sequence[str]) -> dict[str, Result]:
    """The results of ``ids`` present in Redis now, by request id."""
    async with redis_reader(redis_url) as client:
        values = await _values(client, ids)
    return {i: decode_result(v) for i, v in zip(ids, values, strict=True) if v is not None}


async def count_results(redis_url: str, ids: Sequence[str]) -> int:
    """How many of ``ids`` have a result in Redis now (cheap: nothing is read back)."""
    async with redis_reader(redis_url) as client:
        return len(ids) - len(await _missing(client, ids))


async def _missing(client: RedisReader, ids: Sequence[str]) -> list[str]:
    found: list[int] = []
    for start in range(0, len(ids), _CHUNK):
        keys = [result_key(i) for i in ids[start : start + _CHUNK]]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        found += await pipe.execute()
    return [i for i, there in zip(ids, found, strict=True) if not there]


async def await_results(
    redis_url: str,
    ids: Sequence[str],
    timeout_s: float,
    *,
    at_least: int | None = None,
    watch: Sequence[str] = (),
    poll_s: float = 0.2,
) -> list[str]:
    """Poll Redis until every id (or ``at_least`` of them) has a result, or ``timeout_s``
    passes; returns the ids still without one.

    Each poll asks only for the ids still missing. With ``watch`` (say the last request
    of each partition, which a worker answers last), only those are polled until they
    are in, then the rest. (A monotonic deadline, not ``asyncio.timeout``: the Redis
    client may swallow the cancellation that ``asyncio.timeout`` relies on.)
    """
    enough = len(ids) if at_least is None else at_least
    deadline = time.monotonic() + timeout_s
    async with redis_reader(redis_url) as client:
        first = list(watch)
        while first and time.monotonic() < deadline:
            first = await _missing(client, first)
            if first:
                await asyncio.sleep(poll_s)  # polling interval, not a wait for readiness
        missing = await _missing(client, ids)
        while len(ids) - len(missing) < enough and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            missing = await _missing(client, missing)
    return missing


async def wait_for_results(
    redis_url: str, ids: Sequence[str], timeout_s: float, poll_s: float = 0.2
) -> dict[str, Result]:
    """Wait until every id has a result or ``timeout_s`` passes; returns what is there
    either way, so a caller can show exactly what is missing."""
    await await_results(redis_url, ids, timeout_s, poll_s=poll_s)
    return await read_results(redis_url, ids)


async def until_answered(
    redis_url: str, ids: Sequence[str], count: int, timeout_s: float = 120
) -> None:
    """Wait until at least ``count`` of ``ids`` have results (say, to inject a fault then);
    raises ``TimeoutError`` if they do not come within ``timeout_s``."""
    missing = await await_results(redis_url, ids, timeout_s, at_least=count, poll_s=0.05)
    if len(ids) - len(missing) < count:
        raise TimeoutError(f"only {len(ids) - len(missing)} of {count} answered in {timeout_s} s")


async def delete_results(redis_url: str, ids: Sequence[str]) -> None:
    async with redis_reader(redis_url) as client:
        for start in range(0, len(ids), _CHUNK):
            # A cluster client splits the keys by slot.
            await client.delete(*(result_key(i) for i in ids[start : start + _CHUNK]))


@dataclass(frozen=True)
class Tally:
    """What became of a run's requests, counted from Redis and the reply topic."""

    produced: int
    answered: int  # ids with a result in Redis and on the reply topic
    lost: int  # produced but not answered
    duplicate_visible: int  # ids whose answer differs between Redis and reply records
    redelivered: int  # ids answered more than once on the reply topic (the same bytes)
    reply_records: int  # records on the reply topic, all ids together


async def tally(
    bootstrap: str,
    redis_url: str,
    results_topic: str,
    ids: Sequence[str],
    timeout_s: float = 120,
    isolation_level: Isolation = "read_uncommitted",
) -> Tally:
    """Wait for every id's answer (up to ``timeout_s``), then count what reached Redis and
    ``results_topic`` (as a reader with ``isolation_level`` sees it)."""
    await await_results(redis_url, ids, timeout_s)
    async with redis_reader(redis_url) as client:
        stored = await _values(client, ids)
    in_redis = {i: v for i, v in zip(ids, stored, strict=True) if v is not None}
    replies = await read_topic(bootstrap, results_topic, len(in_redis), 60, isolation_level)
    documents: dict[str, set[bytes]] = defaultdict(set)
    copies: dict[str, int] = defaultdict(int)
    for record in replies:
        key = record.key.decode()
        documents[key].add(record.value)
        copies[key] += 1
    answered = [i for i in ids if i in in_redis and i in documents]
    return Tally(
        produced=len(ids),
        answered=len(answered),
        lost=len(ids) - len(answered),
        duplicate_visible=sum(1 for i in answered if documents[i] != {in_redis[i]}),
        redelivered=sum(1 for i in answered if copies[i] > 1),
        reply_records=len(replies),
    )
