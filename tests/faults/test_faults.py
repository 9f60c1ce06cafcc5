"""Fault scenarios: inject a fault mid-stream, then count what was lost or changed.

Each test asserts lost = 0 and duplicate-visible = 0 and adds its row to the
table printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import time
import zlib
from datetime import UTC, datetime, timedelta

import pytest

from schemas import ContentType, OutgoingRecord, Status, encode_request, topics_for
from tests.faults.conftest import LocalService, Workers, check, setup, tally, until_answered
from tests.faults.faulty import poison_png
from tests.integration.harness import (
    produce,
    read_topic,
    redis_results,
)

FAULTY = "tests.faults.faulty:FaultyDigits"


@pytest.mark.timeout(240)
async def test_sigkill_mid_batch_then_restart(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 3000)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    first = workers.start("--max-batch-size", "8")
    await until_answered(redis_url, ids, 100)
    first.signal(signal.SIGKILL)
    first.wait()
    assert len(await redis_results(redis_url, ids)) < len(ids), "the kill must land mid-stream"
    workers.start("--max-batch-size", "8")
    row = await tally(
        "worker SIGKILL mid-batch, restart", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())


@pytest.mark.timeout(240)
async def test_sigterm_drain_then_restart_reprocesses_nothing(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 3000)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    first = workers.start("--max-batch-size", "8")
    await until_answered(redis_url, ids, 100)
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    assert len(await redis_results(redis_url, ids)) < len(ids), "the stop must land mid-stream"
    workers.start("--max-batch-size", "8")
    row = await tally(
        "worker SIGTERM (drain), restart", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())
    assert row.redelivered == 0, "a clean drain commits everything it answered"


@pytest.mark.timeout(240)
async def test_redis_stopped_for_ten_seconds(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    model_name: str,
    private_redis: LocalService,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 3000)
    topic = topics_for(model_name).requests
    await produce(kafka_bootstrap, topic, records[:1500])
    workers.start("--max-batch-size", "8", redis_url=private_redis.url)
    await until_answered(private_redis.url, ids, 100)
    private_redis.stop()
    await produce(kafka_bootstrap, topic, records[1500:])  # keeps arriving during the outage
    await asyncio.sleep(10)  # the outage itself: this is the fault, not a wait for readiness
    private_redis.start()
    row = await tally(
        "Redis stopped 10 s mid-run", kafka_bootstrap, private_redis.url, model_name, ids
    )
    check(row, workers.logs())
    assert "redis failed" in workers.logs()  # the outage really hit the worker


@pytest.mark.timeout(300)
async def test_kafka_broker_stopped_and_restarted(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
    private_kafka: LocalService,
) -> None:
    bootstrap = private_kafka.bootstrap
    records, ids = await setup(bootstrap, model_name, digits, 3000)
    await produce(bootstrap, topics_for(model_name).requests, records[:2000])
    workers.start("--max-batch-size", "8", bootstrap=bootstrap)
    await until_answered(redis_url, ids, 100)
    private_kafka.stop()
    private_kafka.start()
    await produce(bootstrap, topics_for(model_name).requests, records[2000:])
    row = await tally(
        "Kafka broker stopped and restarted", bootstrap, redis_url, model_name, ids, 180
    )
    check(row, workers.logs())


@pytest.mark.timeout(300)
async def test_second_worker_joins_then_leaves(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 6000, partitions=6)
    topic = topics_for(model_name).requests
    await produce(kafka_bootstrap, topic, records[:2000])
    workers.start("--max-batch-size", "4")
    await until_answered(redis_url, ids, 200)
    second = workers.start("--max-batch-size", "4")  # rebalance 1: it joins
    deadline = time.monotonic() + 90
    while "partitions assigned: conveyor" not in second.log():
        assert time.monotonic() < deadline, "the second worker never got partitions"
        await asyncio.sleep(0.1)
    await produce(kafka_bootstrap, topic, records[2000:4000])
    assert second.proc is not None
    second_id = f"{socket.gethostname()}-{second.proc.pid}"
    deadline = time.monotonic() + 120
    while not any(r.worker == second_id for r in (await redis_results(redis_url, ids)).values()):
        assert time.monotonic() < deadline, "the second worker never answered"
        await asyncio.sleep(0.2)
    second.signal(signal.SIGTERM)  # rebalance 2: it leaves, draining its partitions first
    assert second.wait() == 0
    await produce(kafka_bootstrap, topic, records[4000:])  # its partitions must move back
    row = await tally(
        "second worker joins, then leaves", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())


@pytest.mark.timeout(180)
async def test_one_poison_item_fails_alone(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 63, partitions=1)
    poison = encode_request(
        poison_png(),
        request_id=f"{model_name}-poison",
        content_type=ContentType.PNG,
        source="tests",
    )
    records.insert(31, poison)
    ids.insert(31, poison.key.decode())
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    workers.start("--max-batch-size", "64", "--max-delay-ms", "500", spec=FAULTY)
    row = await tally("one poison item in a batch", kafka_bootstrap, redis_url, model_name, ids)
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    failed = {i for i, r in results.items() if r.status is not Status.ok}
    assert failed == {poison.key.decode()}
    error = results[poison.key.decode()].error
    assert error is not None
    assert error.code == "model_error"
    assert max(r.timings.batch_size for r in results.values() if r.timings) > 1  # it was batched
    dead = await read_topic(kafka_bootstrap, topics_for(model_name).dlq, expect=1, timeout=30)
    assert [r.key for r in dead] == [poison.key]


def _bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A tiny PNG that declares a huge image: only its header is valid."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def _hand_built(request_id: str | None, value: bytes, **overrides: bytes) -> OutgoingRecord:
    headers = {
        "ce_specversion": b"1.0",
        "ce_type": b"conveyor.request.v1",
        "ce_source": b"tests",
        "content-type": b"image/png",
    }
    if request_id is not None:
        headers["ce_id"] = request_id.encode()
    headers.update({k.replace("_dash_", "-"): v for k, v in overrides.items()})
    key = (request_id or "no-id").encode()
    return OutgoingRecord(key, value, list(headers.items()))


@pytest.mark.timeout(180)
async def test_every_poison_kind(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    good, good_ids = await setup(kafka_bootstrap, model_name, digits, 30, partitions=1)
    png = digits[0][0]
    m = model_name
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat().encode()
    with_id: dict[str, tuple[OutgoingRecord, Status, str]] = {
        f"{m}-type": (
            _hand_built(f"{m}-type", png, ce_type=b"com.example.other"),
            Status.rejected,
            "unsupported_type",
        ),
        f"{m}-media": (
            _hand_built(f"{m}-media", b"hi", content_dash_type=b"text/plain"),
            Status.error,
            "unsupported_media_type",
        ),
        f"{m}-trunc": (
            _hand_built(f"{m}-trunc", png[: len(png) // 2]),
            Status.error,
            "decode_failed",
        ),
        f"{m}-jpeg": (
            _hand_built(f"{m}-jpeg", b"\xff\xd8\xff\xe0garbage", content_dash_type=b"image/jpeg"),
            Status.error,
            "decode_failed",
        ),
        f"{m}-bomb": (_hand_built(f"{m}-bomb", _bomb_png()), Status.error, "image_too_large"),
        f"{m}-big": (
            _hand_built(f"{m}-big", png + b"\0" * 70_000),
            Status.error,
            "payload_too_large",
        ),
        f"{m}-params": (
            _hand_built(f"{m}-params", png, ce_params=b'{"top_k": '),
            Status.error,
            "bad_request",
        ),
        f"{m}-late": (_hand_built(f"{m}-late", png, ce_deadline=past), Status.expired, "expired"),
        f"{m}-model": (_hand_built(f"{m}-model", poison_png()), Status.error, "model_error"),
    }
    no_id = [_hand_built(None, png), _hand_built("bad id with spaces", png)]
    records = good[:15] + [r for r, _, _ in with_id.values()] + no_id + good[15:]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    workers.start(
        "--max-batch-size", "16", spec=FAULTY, env={"CONVEYOR_LIMITS__MAX_PAYLOAD_BYTES": "65536"}
    )

    ids = good_ids + list(with_id)
    row = await tally(
        "every poison kind, mixed with good", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    assert all(results[i].status is Status.ok for i in good_ids)
    for request_id, (_record, status, code) in with_id.items():
        result = results[request_id]
        assert result.status is status, result
        assert result.error is not None
        assert result.error.code == code, result
    # Every poison record, with an id or not, has a copy on the dead-letter topic.
    poison_count = len(with_id) - 1 + len(no_id)  # the expired request is answered, not poison
    dead = await read_topic(
        kafka_bootstrap, topics_for(model_name).dlq, expect=poison_count, timeout=30
    )
    codes = sorted(dict(r.headers)["conveyor_error_code"].decode() for r in dead)
    expected = sorted([c for _, s, c in with_id.values() if c != "expired"] + ["bad_request"] * 2)
    assert codes == expected


@pytest.mark.timeout(180)
async def test_injected_out_of_memory_splits_batches(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 600)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    workers.start("--max-batch-size", "32", spec=FAULTY, env={"CONVEYOR_TEST_OOM_ABOVE": "4"})
    row = await tally("out-of-memory on batches > 4", kafka_bootstrap, redis_url, model_name, ids)
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    assert all(r.status is Status.ok for r in results.values())
    assert max(r.timings.batch_size for r in results.values() if r.timings) > 4  # really split


@pytest.mark.timeout(120)
async def test_item_out_of_memory_alone_gets_out_of_memory(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 5, partitions=1)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    workers.start("--max-batch-size", "8", spec=FAULTY, env={"CONVEYOR_TEST_OOM_ABOVE": "0"})
    row = await tally("out-of-memory even alone", kafka_bootstrap, redis_url, model_name, ids)
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    assert {r.error.code for r in results.values() if r.error} == {"out_of_memory"}
