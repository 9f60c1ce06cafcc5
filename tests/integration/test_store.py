"""The result store's one script per batch, against the real Redis server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from schemas import result_key
from workers.publish.result_store import RedisResultStore


async def test_first_write_wins_and_announces(redis_client: aioredis.Redis, uid: str) -> None:
    store = RedisResultStore(redis_client, ttl_s=60)
    ids = [f"{uid}-a", f"{uid}-b"]
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(*(result_key(i) for i in ids))
    for _ in ids:  # the subscription confirmations
        await pubsub.get_message(timeout=5)
    try:
        assert await store.write_first(ids, [b"first-a", b"first-b"]) == [None, None]
        announced: set[str] = set()
        while len(announced) < len(ids):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            assert message is not None, f"no wake-up for {set(ids) - announced}"
            announced.add(message["channel"].decode())
        assert announced == {result_key(i) for i in ids}

        # A redelivered request: the stored answer comes back and stays.
        again = await store.write_first([ids[0], f"{uid}-c"], [b"second-a", b"first-c"])
        assert again == [b"first-a", None]
        assert await redis_client.get(result_key(ids[0])) == b"first-a"
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
        ttl = await redis_client.ttl(result_key(ids[0]))
        assert 0 < ttl <= 60
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
        await redis_client.delete(*(result_key(i) for i in [*ids, f"{uid}-c"]))


async def test_script_reloaded_after_flush(redis_client: aioredis.Redis, uid: str) -> None:
    """A Redis restart forgets loaded scripts (NOSCRIPT): the store loads it again."""
    store = RedisResultStore(redis_client, ttl_s=60)
    request_id = f"{uid}-x"
    try:
        assert await store.write_first([f"{uid}-w"], [b"w"]) == [None]
        await redis_client.script_flush()
        assert await store.write_first([request_id], [b"x"]) == [None]
        assert await redis_client.get(result_key(request_id)) == b"x"
    finally:
        await redis_client.delete(result_key(request_id), result_key(f"{uid}-w"))


async def test_concurrent_writers_agree_on_one_answer(
    redis_client: aioredis.Redis, uid: str
) -> None:
    """Two workers answering the same ids at once: each id ends with exactly one of the
    two answers, and each writer learns which."""
    store = RedisResultStore(redis_client, ttl_s=60)
    ids = [f"{uid}-{n}" for n in range(200)]
    try:
        a, b = await asyncio.gather(
            store.write_first(ids, [b"A"] * len(ids)), store.write_first(ids, [b"B"] * len(ids))
        )
        for request_id, seen_a, seen_b in zip(ids, a, b, strict=True):
            stored = await redis_client.get(result_key(request_id))
            assert (seen_a, seen_b) in ((None, b"A"), (b"B", None))
            assert stored == (b"A" if seen_a is None else b"B")
    finally:
        await redis_client.delete(*(result_key(i) for i in ids))
