"""The result store's cost per result: one script call per batch, with and without hiredis.

    python -m bench.redis_store [--redis-url URL] [--batch 256] [--batches 400]

Times ``workers.publish.result_store.RedisResultStore.write_first`` (one ``EVALSHA`` per batch:
the grant check, then ``SET NX EX`` and ``PUBLISH`` for each result) against the same
script without its grant check (``GRANT_CHECK``) and against the previous design's
pipelined ``SET NX EX`` + ``PUBLISH`` per result, each with redis-py's hiredis
parser and with its pure-Python one, alternating, in one run. Prints, per result,
microseconds of the client (median wall time of the calls, Redis on loopback) and of
Redis itself (the mean from its ``INFO commandstats``, reset before each run, so the
Redis must be one of the bench's own), the lower the better; the point is the ratios,
not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

from schemas import result_key
from workers.publish.result_store import GRANT_CHECK, WRITE_FIRST_SCRIPT, RedisResultStore

_VALUE = b'{"id":"x","status":"ok","outputs":[1,2,3],"timings":{"batch_size":256}}' * 4

Call = Callable[[list[str], list[bytes]], Awaitable[Any]]


async def _per_result(
    client: aioredis.Redis, call: Call, batch: int, batches: int
) -> tuple[float, float]:
    """Microseconds per result of the client (median over ``batches`` calls of ``batch``
    fresh ids) and of Redis (its commands' time over all of them)."""
    run = uuid.uuid4().hex[:8]
    samples = []
    await client.config_resetstat()
    for n in range(batches):
        ids = [f"bench-store-{run}-{n}-{k}" for k in range(batch)]
        values = [_VALUE] * batch
        start = time.perf_counter()
        await call(ids, values)
        samples.append((time.perf_counter() - start) / batch * 1e6)
    stats = await client.info("commandstats")
    # A script's own calls are counted as well as the script: count the script alone.
    sent = ["cmdstat_evalsha"] if "cmdstat_evalsha" in stats else ["cmdstat_set", "cmdstat_publish"]
    server_us = sum(stats[name]["usec"] for name in sent if name in stats)
    return statistics.median(samples), server_us / (batch * batches)


def _variants(client: aioredis.Redis) -> dict[str, Call]:
    store = RedisResultStore(client, ttl_s=60)
    unchecked = client.register_script(WRITE_FIRST_SCRIPT.replace(GRANT_CHECK, ""))

    async def without_check(ids: list[str], values: list[bytes]) -> None:
        await unchecked(keys=[result_key(i) for i in ids], args=[60, *values])

    async def per_result(ids: list[str], values: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for request_id, value in zip(ids, values, strict=True):
            pipe.set(result_key(request_id), value, nx=True, ex=60)
        for request_id in ids:
            pipe.publish(result_key(request_id), b"")
        await pipe.execute()

    return {
        "one script per batch": store.write_first,
        "the script without its grant check": without_check,
        "SET NX + PUBLISH per result": per_result,
    }


async def _run(url: str, batch: int, batches: int) -> dict[str, tuple[float, float]]:
    results: dict[str, list[tuple[float, float]]] = {}
    clients = {
        "hiredis": aioredis.Redis.from_url(url, parser_class=_AsyncHiredisParser),
        "python parser": aioredis.Redis.from_url(url, parser_class=_AsyncRESP2Parser),
    }
    try:
        for _round in range(3):  # alternate, so drift on a shared machine hits all alike
            for name, client in clients.items():
                for variant, call in _variants(client).items():
                    cost = await _per_result(client, call, batch, batches)
                    results.setdefault(f"{variant}, {name}", []).append(cost)
    finally:
        for client in clients.values():
            await client.aclose()
    return {
        name: (statistics.median(c for c, _ in costs), statistics.median(r for _, r in costs))
        for name, costs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_store", description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    medians = asyncio.run(_run(args.redis_url, args.batch, args.batches))
    print(f"\nµs per result, batches of {args.batch}, median of 3 rounds")
    print(f"  {'':<55} {'client':>7} {'Redis':>7}")
    for name, (client_us, redis_us) in medians.items():
        print(f"  {name:<55} {client_us:7.2f} {redis_us:7.2f}")


if __name__ == "__main__":
    main()
