"""The client SDK against the real broker, Redis and a real worker process.

Tests that only concern waiting write result documents into Redis themselves,
the way a worker does (SET, then PUBLISH on the key's channel), so they control
exactly when a result lands.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from pydantic import SecretStr

from producers import (
    AsyncClient,
    Client,
    ClientSettings,
    RecordTooLarge,
    Result,
    ResultTimeout,
    ServiceUnavailable,
    Status,
    UnknownModel,
)
from producers.admin import create_model_topics
from producers.results import ResultReader
from schemas import encode_result, ok_result, result_key, topics_for


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

    async def connections(self, name: str, expected: int) -> int:
        """Connections named ``name``, once they number ``expected`` or after 2 s.

        Redis handles a client's disconnect and our CLIENT LIST in whichever order
        their sockets' events come, so a count taken at once may be stale.
        """
        for _ in range(200):
            clients = await self.redis.client_list()
            count = sum(1 for client in clients if client.get("name") == name)
            if count == expected:
                break
            await asyncio.sleep(0.01)
        return count

    async def close(self) -> None:
        if self.written:
            await self.redis.delete(*self.written)
        await self.redis.aclose()


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
    subscribe = ResultReader._subscribe

    async def subscribe_then_land(
        self: ResultReader, pubsub: object, channels: Sequence[str], notified: set[str]
    ) -> None:
        await subscribe(self, pubsub, channels, notified)  # type: ignore[arg-type]
        await publish.write(request_id, notify=False)

    monkeypatch.setattr(ResultReader, "_subscribe", subscribe_then_land)
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


async def test_waits_give_back_their_connections(
    settings: ClientSettings,
    publish: _Publisher,
    client_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    subscribed = asyncio.Event()
    subscribe = ResultReader._subscribe

    async def subscribe_and_tell(
        self: ResultReader, pubsub: object, channels: Sequence[str], notified: set[str]
    ) -> None:
        await subscribe(self, pubsub, channels, notified)  # type: ignore[arg-type]
        subscribed.set()

    monkeypatch.setattr(ResultReader, "_subscribe", subscribe_and_tell)
    done, missing = publish.new_id("done"), publish.new_id("missing")
    await publish.write(done)
    async with AsyncClient(settings) as client:
        await client.result(done)  # opens the pool's one connection for plain reads
        baseline = 1
        assert await publish.connections(client_name, baseline) == baseline

        await client.wait(done, timeout=5)
        with pytest.raises(ResultTimeout):
            await client.wait(missing, timeout=0.2)
        subscribed.clear()
        cancelled = asyncio.create_task(client.wait(missing, timeout=30))
        await asyncio.wait_for(subscribed.wait(), 5)  # cancelling before would prove nothing
        assert await publish.connections(client_name, baseline + 1) == baseline + 1
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        async with aclosing(client.wait_many([done, missing], timeout=30)) as results:
            async for _result in results:
                break  # stop early
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
