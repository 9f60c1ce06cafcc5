"""`conveyor results rebuild` against the real broker, Redis and a real worker.

A worker answers a backlog (results in Redis and on the reply topic), Redis
loses everything (FLUSHALL, on a Redis of this module's own: the shared one holds
other tests' results), and the command writes the results back from the reply
topic: every id readable again with the very bytes it had, its time to live as it
was, and a second run changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
import redis.asyncio as aioredis

from producers import AsyncClient, ClientSettings, ContentType
from producers.admin import create_model_topics
from producers.cli import main
from producers.testing import Fleet, free_port, produce, requests, until, wait_for_results
from schemas import (
    OutgoingRecord,
    Result,
    Timings,
    encode_result,
    ok_result,
    result_headers,
    result_key,
    topics_for,
)
from tests.harness import LocalService

# One test process runs the module: its Redis starts once under pytest -n.
pytestmark = pytest.mark.xdist_group("rebuild")

DAY_MS = 86_400_000


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This module's Redis, for its workers, clients and command alike."""
    service = LocalService("redis.sh", free_port(), tmp_path_factory.mktemp("redis-rebuild"))
    service.start()
    yield service.url
    service.stop()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _record(result: Result) -> OutgoingRecord:
    return OutgoingRecord(result.id.encode(), encode_result(result), result_headers(result))


async def _snapshot(redis: aioredis.Redis, keys: list[str]) -> tuple[list[bytes], list[int]]:
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
        pipe.pttl(key)
    answers = await pipe.execute()
    return answers[0::2], answers[1::2]


async def _rebuild(
    connection: list[str], model: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, int]:
    argv = [*connection, "results", "rebuild", "--model", model, "--no-progress"]
    status = await asyncio.to_thread(main, argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    report: dict[str, int] = orjson.loads(captured.out)
    return report


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_rebuild_restores_every_result_as_it_was(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    drop_topics.append(model_name)
    records, ids = requests([png for png, _ in digits[:10]], 300, model_name, ContentType.PNG)
    await produce(kafka_bootstrap, topics.requests, records)
    with workers.start() as worker:
        answered = await wait_for_results(redis_url, ids, timeout_s=120)
        assert len(answered) == len(ids), worker.log()
    keys = [result_key(i) for i in ids]
    values, ttls = await _snapshot(redis, keys)
    snapshot_at = time.monotonic()

    # What else a reply topic may hold: a later answer to an answered id (a redelivery
    # whose first answer had not reached Redis), a result whose time is up, and a record
    # that is no result at all.
    now_ms = time.time() * 1000
    later = ok_result(ids[0], [{"label": "later"}], model=model_name, model_version="1", worker="x")
    old_timings = Timings(
        produced_ms=int(now_ms - 2 * DAY_MS),
        received_ms=now_ms - 2 * DAY_MS,
        finished_ms=now_ms - 2 * DAY_MS,
        queue_ms=0,
        inference_ms=0,
        batch_size=1,
        published_ms=now_ms - 2 * DAY_MS,
    )
    old = ok_result(
        f"{model_name}-old",
        [],
        model=model_name,
        model_version="1",
        worker="x",
        timings=old_timings,
    )
    junk = OutgoingRecord(b"junk", b"not a result", [])
    await produce(kafka_bootstrap, topics.results, [_record(later), _record(old), junk])

    await redis.flushall()  # Redis lost its data
    connection = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    async with AsyncClient(client_settings) as client:
        # Subscribed before the rebuild: woken by its PUBLISH, as by a worker's.
        waiter = asyncio.create_task(client.wait(ids[-1], timeout=60))

        async def subscribed() -> bool:
            return bool(await redis.pubsub_channels(result_key(ids[-1])))

        await until(subscribed, "the wait subscribed", 10)
        first = await _rebuild(connection, model_name, capsys)
        assert (await waiter).id == ids[-1]
    rebuilt, rebuilt_ttls = await _snapshot(redis, keys)
    elapsed_ms = (time.monotonic() - snapshot_at) * 1000

    assert first["read"] == len(ids) + 3
    assert first["written"] == len(ids)
    assert first["present"] == 1  # the later answer: the first one stays
    assert first["expired"] == 1
    assert first["skipped"] == 1
    assert rebuilt == values  # every id readable again, byte for byte
    assert await redis.exists(result_key(old.id)) == 0
    for before, after in zip(ttls, rebuilt_ttls, strict=True):
        # What was left of the result's day then, less the time since: to a second.
        assert abs(after - (before - elapsed_ms)) < 1000, (before, after, elapsed_ms)

    second = await _rebuild(connection, model_name, capsys)
    assert second["read"] == first["read"]
    assert second["written"] == 0
    assert second["present"] == len(ids) + 1
    again, _ = await _snapshot(redis, keys)
    assert again == values


async def test_rebuild_of_a_model_without_topics_says_so(
    kafka_bootstrap: str, redis_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    status = await asyncio.to_thread(
        main, [*argv, "results", "rebuild", "--model", f"none{uid}", "--no-progress"]
    )
    assert status == 2
    assert f"topic conveyor.none{uid}.results does not exist" in capsys.readouterr().err
