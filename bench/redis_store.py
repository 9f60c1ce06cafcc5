"""The result store's cost per result: one script call per batch, with and without hiredis.

    python -m bench.redis_store [--redis-url URL] [--batch 256] [--batches 400]

Times ``workers.publish.result_store.RedisResultStore.write_first`` (one ``EVALSHA`` per batch:
the grant check, then ``SET NX EX`` and ``PUBLISH`` for each result) against the same
script without its grant check (``GRANT_CHECK``) and against the previous design's
pipelined ``SET NX EX`` + ``PUBLISH`` per result, each with redis-py's hiredis
parser and with its pure-Python one, alternating, in one run. Prints microseconds
of the client per result (wall time of the calls, Redis on loopback), the lower
the better; the point is the ratios, not the absolute numbers.
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


async def _per_result(
    call: Callable[[list[str], list[bytes]], Awaitable[Any]], batch: int, batches: int
) -> float:
    """Microseconds per result over ``batches`` calls of ``batch`` fresh ids."""
    run = uuid.uuid4().hex[:8]
    samples = []
    for n in range(batches):
        ids = [f"bench-store-{run}-{n}-{k}" for k in range(batch)]
        values = [_VALUE] * batch
        start = time.perf_counter()
        await call(ids, values)
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(samples)


async def _run(url: str, batch: int, batches: int) -> dict[str, float]:
    results: dict[str, list[float]] = {}
    clients = {
        "hiredis": aioredis.Redis.from_url(url, parser_class=_AsyncHiredisParser),
        "python parser": aioredis.Redis.from_url(url, parser_class=_AsyncRESP2Parser),
    }
    try:
        for _round in range(3):  # alternate, so drift on a shared machine hits all alike
            for name, client in clients.items():
                store = RedisResultStore(client, ttl_s=60)
                script = await _per_result(store.write_first, batch, batches)
                results.setdefault(f"one script per batch, {name}", []).append(script)
                unchecked = client.register_script(WRITE_FIRST_SCRIPT.replace(GRANT_CHECK, ""))

                async def without_check(
                    ids: list[str], values: list[bytes], script: Any = unchecked
                ) -> None:
                    await script(keys=[result_key(i) for i in ids], args=[60, *values])

                bare = await _per_result(without_check, batch, batches)
                results.setdefault(f"the script without its grant check, {name}", []).append(bare)

                async def per_result(
                    ids: list[str], values: list[bytes], client: aioredis.Redis = client
                ) -> None:
                    pipe = client.pipeline(transaction=False)
                    for request_id, value in zip(ids, values, strict=True):
                        pipe.set(result_key(request_id), value, nx=True, ex=60)
                    for request_id in ids:
                        pipe.publish(result_key(request_id), b"")
                    await pipe.execute()

                pipelined = await _per_result(per_result, batch, batches)
                results.setdefault(f"SET NX + PUBLISH per result, {name}", []).append(pipelined)
    finally:
        for client in clients.values():
            await client.aclose()
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_store", description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    medians = asyncio.run(_run(args.redis_url, args.batch, args.batches))
    print(f"\nµs of client time per result, batches of {args.batch}, median of 3 rounds")
    for name, value in medians.items():
        print(f"  {name:<55} {value:6.2f}")


if __name__ == "__main__":
    main()
