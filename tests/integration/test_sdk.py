"""The client SDK against the real broker, Redis and a real worker process.

Tests that only concern waiting write result documents into Redis themselves,
the way a worker does (SET, then PUBLISH on the key's channel), so they control
exactly when a result lands.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, suppress
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from pydantic import SecretStr

from producers import (
    AsyncClient,
    Client,
    ClientSettings,
    ConnectionsBusy,
    RecordTooLarge,
    Result,
    ResultTimeout,
    ServiceUnavailable,
    Status,
    UnknownModel,
)
from producers.admin import create_model_topics
from producers.subscriber import Listener, SharedSubscriber
from producers.testing import until
from schemas import cancel_key, encode_result, ok_result, result_key, topics_for

# One test process runs the module: its served_model worker starts once under pytest -n.
pytestmark = pytest.mark.xdist_group("sdk")


@pytest.fixture
def client_name(uid: str) -> str:
    return f"conveyor-test-{uid}"


@pytest.fixture
def settings(kafka_bootstrap: str, redis_url: str, client_name: str) -> ClientSettings:
    return ClientSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=SecretStr(redis_url),
        redis_client_name=client_name,
    )


@pytest.fixture
async def publish(redis_url: str, uid: str) -> AsyncIterator[_Publisher]:
    publisher = _Publisher(aioredis.Redis.from_url(redis_url), uid)
    yield publisher
    await publisher.close()


class _Publisher:
    """Writes results the way a worker does, and deletes them after the test."""

    def __init__(self, redis: aioredis.Redis, uid: str) -> None:
        self.redis = redis
        self.uid = uid
        self.written: list[str] = []

    def new_id(self, name: str) -> str:
        return f"{self.uid}-{name}"

    async def write(self, request_id: str, *, notify: bool = True) -> None:
        result = ok_result(request_id, [{"label": "7"}], model="m", model_version="1", worker="t")
        key = result_key(request_id)
        self.written.append(key)
        await self.redis.set(key, encode_result(result), nx=True, ex=60)
        if notify:
            await self.redis.publish(key, b"")

    async def write_many(self, request_ids: Sequence[str], *, notify: bool = True) -> None:
        """``write`` for many ids, in pipelines of 500: each SET NX EX, then its PUBLISH."""
        for start in range(0, len(request_ids), 500):
            pipe = self.redis.pipeline(transaction=False)
            for request_id in request_ids[start : start + 500]:
                result = ok_result(request_id, [], model="m", model_version="1", worker="t")
                key = result_key(request_id)
                self.written.append(key)
                pipe.set(key, encode_result(result), nx=True, ex=60)
                if notify:
                    pipe.publish(key, b"")
            await pipe.execute()

    async def connections(self, name: str, expected: int) -> int:
        """Connections named ``name``, once they number ``expected`` or after 2 s.

        Redis handles a client's disconnect and our CLIENT LIST in whichever order
        their sockets' events come, so a count taken at once may be stale.
        """

        async def count() -> int:
            clients = await self.redis.client_list()
            return sum(1 for client in clients if client.get("name") == name)

        return await _settled(count, expected)

    async def channels(self, expected: int, within_s: float = 60) -> int:
        """Channels of this test's ids that clients subscribe to, once they number
        ``expected`` or after ``within_s`` (commands of other connections land in their
        own time, later on a busy machine)."""

        async def count() -> int:
            return len(await self.redis.pubsub_channels(f"{result_key(self.uid)}*"))

        return await _settled(count, expected, within_s)

    async def close(self) -> None:
        if self.written:
            await self.redis.delete(*self.written)
        await self.redis.aclose()


async def _settled(count: Callable[[], Awaitable[int]], expected: int, within_s: float = 2) -> int:
    """``count()`` once it is ``expected``, or as it stands after ``within_s``, for the
    caller's assertion to show."""
    seen = -1

    async def reached() -> bool:
        nonlocal seen
        seen = await count()
        return seen == expected

    with suppress(TimeoutError):
        await until(reached, f"a count of {expected}", within_s)
    return seen


def _accuracy(results: Sequence[tuple[int, int]]) -> float:
    return sum(predicted == truth for predicted, truth in results) / len(results)


async def test_async_submit_and_wait(
    settings: ClientSettings, served_model: str, digits: list[tuple[bytes, int]]
) -> None:
    png, _digit = digits[0]
    async with AsyncClient(settings) as client:
        request_id = await client.submit(png, model=served_model, params={"top_k": 2})
        result = await client.wait(request_id, timeout=60)
    assert result.id == request_id
    assert result.status is Status.ok, result
    assert result.model == served_model
    assert len(result.outputs) == 2  # the params reached the model


def test_sync_submit_many_and_wait_many(
    settings: ClientSettings,
    served_model: str,
    digits: list[tuple[bytes, int]],
    tmp_path: Path,
) -> None:
    files = []
    digits = digits[:20]
    for n, (png, _digit) in enumerate(digits):
        files.append(tmp_path / f"{n}.png")
        files[-1].write_bytes(png)
    with Client(settings) as client:
        ids = client.submit_many(files, model=served_model)
        results = list(client.wait_many(ids, timeout=60))
        assert client.result(ids[0]) == next(r for r in results if r.id == ids[0])
    assert sorted(r.id for r in results) == sorted(ids)
    truth = dict(zip(ids, (digit for _png, digit in digits), strict=True))
    assert _accuracy([(r.outputs[0]["index"], truth[r.id]) for r in results]) >= 0.9


async def test_wait_many_yields_in_completion_order(
    settings: ClientSettings, publish: _Publisher
) -> None:
    first, second, third, already = (publish.new_id(n) for n in ("a", "b", "c", "done"))
    await publish.write(already)
    seen: list[str] = []
    arrived = asyncio.Event()

    async def worker() -> None:
        for request_id in (third, first, second):  # not the order they were asked for
            await arrived.wait()  # each after the previous one reached the caller
            arrived.clear()
            await publish.write(request_id)

    async with AsyncClient(settings) as client:
        task = asyncio.create_task(worker())
        async for result in client.wait_many([first, second, third, already], timeout=10):
            seen.append(result.id)
            arrived.set()
        await task
    assert seen == [already, third, first, second]


async def test_result_landing_while_subscribing_is_not_missed(
    settings: ClientSettings, publish: _Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result lands after SUBSCRIBE but before the first read, and its notification is lost.

    Only the read after subscribing can find it; a client that read first and
    subscribed second would wait for a notification that never comes.
    """
    request_id = publish.new_id("race")
    add = SharedSubscriber.add

    async def subscribe_then_land(
        self: SharedSubscriber, listener: Listener, channels: Sequence[str]
    ) -> None:
        await add(self, listener, channels)
        await publish.write(request_id, notify=False)

    monkeypatch.setattr(SharedSubscriber, "add", subscribe_then_land)
    async with AsyncClient(settings) as client:
        started = time.monotonic()
        result = await client.wait(request_id, timeout=5)
    assert result.id == request_id
    assert time.monotonic() - started < 2


async def test_result_written_just_before_wait(
    settings: ClientSettings, publish: _Publisher
) -> None:
    request_id = publish.new_id("early")
    await publish.write(request_id)  # its notification went out to nobody
    async with AsyncClient(settings) as client:
        assert (await client.wait(request_id, timeout=5)).id == request_id
        assert (await client.result(request_id)) is not None
        assert (await client.result(publish.new_id("never"))) is None


async def test_timeout_names_the_pending_ids(settings: ClientSettings, publish: _Publisher) -> None:
    done, missing = publish.new_id("done"), publish.new_id("missing")
    await publish.write(done)
    async with AsyncClient(settings) as client:
        with pytest.raises(ResultTimeout, match=missing) as raised:
            await client.wait(missing, timeout=0.3)
        assert raised.value.request_ids == (missing,)
        got: list[str] = []
        with pytest.raises(ResultTimeout) as raised:
            await _collect_ids(client.wait_many([done, missing], timeout=0.3), got)
        assert got == [done]
        assert raised.value.request_ids == (missing,)


async def _collect_ids(results: AsyncIterator[Result], into: list[str]) -> None:
    async for result in results:
        into.append(result.id)


async def test_waits_share_one_subscription_and_give_back_their_channels(
    settings: ClientSettings,
    publish: _Publisher,
    client_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    subscribed = asyncio.Event()
    add = SharedSubscriber.add

    async def add_and_tell(
        self: SharedSubscriber, listener: Listener, channels: Sequence[str]
    ) -> None:
        await add(self, listener, channels)
        subscribed.set()

    monkeypatch.setattr(SharedSubscriber, "add", add_and_tell)
    done, missing = publish.new_id("done"), publish.new_id("missing")
    await publish.write(done)
    # A pool of one: any connection beyond it and the shared subscription's would be a wait's.
    one = settings.model_copy(update={"redis_max_connections": 1})
    async with AsyncClient(one) as client:
        await client.result(done)  # opens the pool's one connection
        await client.wait(done, timeout=5)  # and the shared subscription's
        baseline = 2
        assert await publish.connections(client_name, baseline) == baseline

        with pytest.raises(ResultTimeout):
            await client.wait(missing, timeout=0.2)
        subscribed.clear()
        waits = [asyncio.create_task(client.wait(missing, timeout=30)) for _ in range(3)]
        waits.append(asyncio.create_task(client.wait(publish.new_id("other"), timeout=30)))
        await asyncio.wait_for(subscribed.wait(), 5)  # cancelling before would prove nothing
        assert await publish.channels(2) == 2  # two ids, however many waits
        assert await publish.connections(client_name, baseline) == baseline
        for wait in waits:
            wait.cancel()
        for wait in waits:
            with pytest.raises(asyncio.CancelledError):
                await wait
        async with aclosing(client.wait_many([done, missing], timeout=30)) as results:
            async for _result in results:
                break  # stop early
        assert await publish.channels(0) == 0
        assert await publish.connections(client_name, baseline) == baseline
    assert await publish.connections(client_name, 0) == 0


async def test_sync_client_gives_back_its_connections(
    settings: ClientSettings, publish: _Publisher, client_name: str
) -> None:
    done, missing = publish.new_id("done"), publish.new_id("missing")
    await publish.write(done)

    def use_and_close() -> None:
        with Client(settings) as client:
            assert client.wait(done, timeout=5).id == done
            with pytest.raises(ResultTimeout):
                client.wait(missing, timeout=0.2)
            results: Iterator[object] = client.wait_many([done, missing], timeout=30)
            next(results)
            # Left unfinished: close() must end its subscription too.

    await asyncio.to_thread(use_and_close)
    assert await publish.connections(client_name, 0) == 0


async def test_unknown_model_is_refused_before_sending(settings: ClientSettings, uid: str) -> None:
    model = f"nosuch{uid}"
    async with AsyncClient(settings) as client:
        with pytest.raises(
            UnknownModel, match=rf"topic conveyor\.{model}\.requests does not exist"
        ):
            await client.submit(b"\x89PNG\r\n\x1a\n....", model=model)


async def test_a_record_too_large_for_its_topic_is_reported_as_such(
    settings: ClientSettings, kafka_admin: AIOKafkaAdminClient, uid: str
) -> None:
    """A topic made with Kafka's ~1 MB default refuses a 2 MiB request: the SDK says so
    (with payloads by reference off: on, the payload would go to Redis instead)."""
    settings = settings.model_copy(update={"dataref_store": "off"})
    model = f"small{uid}"
    topic = topics_for(model).requests
    limit = 1024 * 1024
    await kafka_admin.create_topics(
        [NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": str(limit)})]
    )
    try:
        async with AsyncClient(settings) as client:
            with pytest.raises(RecordTooLarge) as refused:
                await client.submit(b"x" * (2 * limit), model=model, content_type="text/plain")
    finally:
        await kafka_admin.delete_topics([topic])
    error = refused.value
    assert (error.topic, error.limit_bytes) == (topic, limit)
    assert error.record_bytes > 2 * limit
    assert not error.retriable
    message = str(error)
    assert f"topic {topic} accepts at most {limit} bytes" in message
    assert f"max.message.bytes={settings.limits.max_record_bytes}" in message
    assert "is the broker running" not in message


async def test_the_largest_payload_fits_the_topics_the_cli_creates(
    settings: ClientSettings, kafka_admin: AIOKafkaAdminClient, uid: str
) -> None:
    model = f"big{uid}"
    states = await create_model_topics(settings, model, partitions=1)
    topics = topics_for(model)
    try:
        assert {s.name: s.max_message_bytes for s in states} == dict.fromkeys(
            [topics.requests, topics.results, topics.dlq], settings.limits.max_record_bytes
        )
        payload = b"x" * settings.limits.max_payload_bytes
        inline = settings.model_copy(update={"dataref_store": "off"})  # in the record itself
        async with AsyncClient(inline) as client:
            request_id = await client.submit(payload, model=model, content_type="text/plain")
        assert request_id
    finally:
        await kafka_admin.delete_topics([topics.requests, topics.results, topics.dlq])


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A port that accepts connections and never answers: a hung broker or Redis."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and disconnects
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "hung"])
async def test_unreachable_services_fail_within_the_bound(refused: bool, silent_port: int) -> None:
    port = 9 if refused else silent_port  # nothing listens on port 9 (discard)
    settings = ClientSettings(
        kafka_bootstrap=f"127.0.0.1:{port}",
        redis_url=SecretStr(f"redis://127.0.0.1:{port}/0"),
        connect_timeout_s=1.0,
    )
    async with AsyncClient(settings) as client:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match=f"cannot reach Kafka at 127.0.0.1:{port}"):
            await client.submit(b"\x89PNG\r\n\x1a\n....", model="digits")
        with pytest.raises(
            ServiceUnavailable, match=f"cannot reach Redis at redis://127.0.0.1:{port}"
        ):
            await client.wait("some-id", timeout=30)
    assert time.monotonic() - started < 5


async def test_keyword_clients_submit_and_wait(
    kafka_bootstrap: str, redis_url: str, served_model: str, digits: list[tuple[bytes, int]]
) -> None:
    png, _digit = digits[0]
    async with AsyncClient(bootstrap=kafka_bootstrap, redis_url=redis_url) as client:
        request_id = await client.submit(png, model=served_model)
        assert (await client.wait(request_id, timeout=60)).status is Status.ok

    def sync() -> None:
        with Client(bootstrap=kafka_bootstrap, redis_url=redis_url) as client:
            assert client.wait(client.submit(png, model=served_model), timeout=60).id

    await asyncio.to_thread(sync)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_five_thousand_concurrent_waits_on_one_client(
    settings: ClientSettings, publish: _Publisher, client_name: str
) -> None:
    """5,000 waits at once on one AsyncClient share one subscription and a pool of 50."""
    count, pool = 5000, 50
    ids = [publish.new_id(f"many{n}") for n in range(count)]
    early = ids[: count // 10]  # written before their waits: found by the first read
    await publish.write_many(early)
    one = settings.model_copy(update={"redis_max_connections": pool})
    async with AsyncClient(one) as client:
        started = time.monotonic()
        waits = [asyncio.create_task(client.wait(i, timeout=120)) for i in ids]
        # Those answered by their first read return with no write of theirs: when they
        # have, they left their channels, and every other wait is still subscribed.
        found = await asyncio.wait_for(asyncio.gather(*waits[: len(early)]), 120)
        assert [r.id for r in found] == early
        late = count - len(early)
        assert await publish.channels(late) == late
        subscribed_s = time.monotonic() - started
        assert not any(wait.done() for wait in waits[len(early) :])
        assert await publish.connections(client_name, pool + 1) <= pool + 1
        written = time.monotonic()
        await publish.write_many(ids[len(early) :])  # SET NX then PUBLISH, as a worker does
        results = await asyncio.gather(*waits)
        answered_s = time.monotonic() - written
        assert [r.id for r in results] == ids
        assert await publish.connections(client_name, pool + 1) <= pool + 1
        assert await publish.channels(0) == 0
    print(
        f"\n{count} concurrent waits: subscribed in {subscribed_s:.2f} s, "
        f"all answered {answered_s:.2f} s after the writes began"
    )


@pytest.mark.slow
async def test_hundreds_of_concurrent_cancels_and_statuses_wait_for_the_pool(
    settings: ClientSettings, publish: _Publisher, client_name: str
) -> None:
    count, pool = 500, 8
    ids = [publish.new_id(f"c{n}") for n in range(count)]
    await publish.write_many(ids[:10])
    small = settings.model_copy(update={"redis_max_connections": pool})
    async with AsyncClient(small) as client:
        statuses = await asyncio.gather(*(client.status(i) for i in ids))
        cancels = await asyncio.gather(*(client.cancel(i) for i in ids))
        assert await publish.connections(client_name, pool) <= pool
    assert [s.state for s in statuses] == ["done"] * 10 + ["queued"] * (count - 10)
    assert [s.state for s in cancels] == ["done"] * 10 + ["queued"] * (count - 10)
    assert await publish.redis.exists(*(cancel_key(i) for i in ids)) == count
    await publish.redis.delete(*(cancel_key(i) for i in ids))


async def test_a_pool_that_stays_busy_is_named_as_the_cause(
    settings: ClientSettings, publish: _Publisher
) -> None:
    one = settings.model_copy(
        update={"redis_max_connections": 1, "redis_pool_timeout_s": 0.2, "connect_timeout_s": 5}
    )
    async with AsyncClient(one) as client:
        await client.result(publish.new_id("warm"))
        await publish.redis.client_pause(1000, all=True)
        first = asyncio.create_task(client.result(publish.new_id("a")))  # holds the connection
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionsBusy) as raised:
            await client.status(publish.new_id("b"))
        assert await first is None  # answered once Redis went on
    message = str(raised.value)
    assert "all 1 Redis connections of this client stayed busy for 0.2 s" in message
    assert "is it running" not in message


async def test_waits_survive_the_loss_of_the_shared_connection(
    settings: ClientSettings, publish: _Publisher, client_name: str
) -> None:
    ids = [publish.new_id(f"lost{n}") for n in range(20)]
    async with AsyncClient(settings) as client:
        waits = [asyncio.create_task(client.wait(i, timeout=30)) for i in ids]
        assert await publish.channels(len(ids)) == len(ids)
        clients = await publish.redis.client_list()
        subscriber = [c["id"] for c in clients if c["name"] == client_name and c["sub"] != "0"]
        assert len(subscriber) == 1
        await publish.redis.client_kill_filter(_id=subscriber[0])
        # Announced at once, likely while no connection listens: a wait that missed the
        # announcement finds the result by reading again once subscribed again.
        await publish.write_many(ids[:10])
        await asyncio.sleep(0.2)
        await publish.write_many(ids[10:])
        results = await asyncio.gather(*waits)
    assert [r.id for r in results] == ids


async def test_status_with_tracking_tells_sent_from_unknown(
    settings: ClientSettings, uid: str, drop_topics: list[str], digits: list[tuple[bytes, int]]
) -> None:
    model = f"track{uid}"
    drop_topics.append(model)
    await create_model_topics(settings, model, partitions=1)
    tracked = settings.model_copy(update={"track_status": True, "status_ttl_s": 60})
    async with AsyncClient(tracked) as client:
        sent = await client.submit(digits[0][0], model=model)  # no worker: it stays queued
        queued = await client.status(sent)
        unknown = await client.status(f"{uid}-never-sent")
    async with AsyncClient(settings) as untracked:
        unknowable = await untracked.status(f"{uid}-never-sent")
    assert queued.state == "queued"
    assert queued.sent_ms is not None
    assert abs(queued.sent_ms / 1000 - time.time()) < 60
    assert unknown.state == "unknown"
    assert unknowable.state == "queued"  # without tracking Redis cannot tell
