"""Faults that used to stop a whole group or stall a partition: hostile records,
rebalances with a slow model, permanent publish errors, decode bombs.

Each scenario states its bound and adds its row to the fault table.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import NewTopic
from prometheus_client.parser import text_string_to_metric_families

from schemas import (
    ContentType,
    ErrorCode,
    OutgoingRecord,
    Status,
    consumer_group,
    encode_request,
    topics_for,
)
from schemas.dlq import ERROR_CODE, ORIGINAL_SHA256, ORIGINAL_SIZE, UNREADABLE_NAMES
from tests.faults.conftest import Workers, admin_for, check, setup, tally, until_answered
from tests.integration.harness import (
    WorkerProcess,
    digit_requests,
    http_get,
    produce,
    read_topic,
    redis_results,
    until,
)

FAULTY = "tests.faults.faulty:FaultyDigits"
SLOW = {"CONVEYOR_TEST_SLOW_MS": "100"}  # 100 ms per batch: a slow model


async def _committed(bootstrap: str, model: str, partitions: int) -> dict[int, int]:
    """The group's committed offset per request partition (-1: none)."""
    topic = topics_for(model).requests
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=consumer_group(model))
    await consumer.start()
    try:
        out = {}
        for p in range(partitions):
            offset = await consumer.committed(TopicPartition(topic, p))
            out[p] = -1 if offset is None else offset
        return out
    finally:
        await consumer.stop()


async def _metric(worker: WorkerProcess, name: str) -> float:
    port = worker.metrics_port()
    assert port is not None, worker.log()
    _, body = await http_get(port, "/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not in /metrics")


def _kcat(bootstrap: str, topic: str, value: bytes, headers: Sequence[bytes], *extra: str) -> None:
    """Produce one record with kcat: header arguments are raw bytes (name=value).

    kcat splits its input at newlines: ``value`` must not contain one.
    """
    assert b"\n" not in value
    kcat = shutil.which("kcat")
    assert kcat, "kcat is not installed; `make install` installs it (Debian package kcat)"
    argv: list[str | bytes] = [kcat, "-P", "-b", bootstrap, "-t", topic, "-p", "0", *extra]
    for header in headers:
        argv += [b"-H", header]
    subprocess.run(argv, input=value, check=True, timeout=30)


def _valid_headers(request_id: str) -> list[bytes]:
    return [
        b"ce_specversion=1.0",
        b"ce_id=" + request_id.encode(),
        b"ce_type=conveyor.request.v1",
        b"ce_source=kcat",
        b"content-type=image/png",
    ]


@pytest.mark.timeout(240)
async def test_hostile_records_never_stop_the_worker(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    """Every kind of bad record, between valid ones: the worker answers the valid ones,
    refuses and dead-letters the bad ones, counts the unreadable ones, commits past all."""
    good, good_ids = await setup(kafka_bootstrap, model_name, digits, 40, partitions=1)
    topic = topics_for(model_name).requests
    png = digits[0][0]
    rng = random.Random(7)
    m = model_name
    await produce(kafka_bootstrap, topic, good[:10])
    # Header names aiokafka's parser refuses (not UTF-8), plain and in a gzip batch.
    for suffix, extra in (("plain", ()), ("gzip", ("-z", "gzip"))):
        _kcat(
            kafka_bootstrap,
            topic,
            b"refused before it is decoded",
            [b"\xff\xfe=v", *_valid_headers(f"{m}-badname-{suffix}")],
            *extra,
        )
    _kcat(kafka_bootstrap, topic, b"\x00\xff" * 50, [b"\xc3\x28=\xff", b"\x80\x81\x82=x"])
    await produce(kafka_bootstrap, topic, good[10:20])
    odd: list[OutgoingRecord] = []
    # A key that is not UTF-8: keys are not part of the contract, so this one is valid.
    valid_key = encode_request(
        png, request_id=f"{m}-oddkey", content_type=ContentType.PNG, source="t"
    )
    odd.append(OutgoingRecord(b"\xff\xfe\x00", valid_key.value, valid_key.headers))
    tombstone = encode_request(
        png, request_id=f"{m}-null", content_type=ContentType.PNG, source="t"
    )
    odd.append(OutgoingRecord(tombstone.key, None, tombstone.headers))  # type: ignore[arg-type]
    huge = encode_request(png, request_id=f"{m}-huge", content_type=ContentType.PNG, source="t")
    odd.append(OutgoingRecord(huge.key, huge.value, [*huge.headers, ("x-big", b"h" * 70_000)]))
    for _ in range(5):  # random bytes in every field
        names = [rng.randbytes(rng.randint(1, 12)).decode("utf-8", "replace") for _n in range(3)]
        odd.append(
            OutgoingRecord(
                rng.randbytes(rng.randint(0, 20)),
                rng.randbytes(rng.randint(1, 200)),
                [(name, rng.randbytes(rng.randint(0, 40))) for name in names],
            )
        )
    await produce(kafka_bootstrap, topic, odd)
    await produce(kafka_bootstrap, topic, good[20:])
    worker = workers.start("--max-batch-size", "8", spec=FAULTY)
    answerable = [
        *good_ids,
        f"{m}-oddkey",
        f"{m}-null",
        f"{m}-huge",
        f"{m}-badname-plain",
        f"{m}-badname-gzip",
    ]
    row = await tally(
        "hostile records interleaved (11 kinds)", kafka_bootstrap, redis_url, m, answerable
    )
    check(row, workers.logs())
    results = await redis_results(redis_url, answerable)
    assert all(results[i].status is Status.ok for i in [*good_ids, f"{m}-oddkey"])
    for bad in ("null", "huge", "badname-plain", "badname-gzip"):
        error = results[f"{m}-{bad}"].error
        assert error is not None
        assert error.code == ErrorCode.bad_request
    assert "UTF-8" in results[f"{m}-badname-gzip"].error.message  # type: ignore[union-attr]
    dead = await read_topic(kafka_bootstrap, topics_for(m).dlq, expect=10, timeout=30)
    assert len(dead) == 10  # 3 from kcat, null, huge, 5 random: each copied once
    assert all(ERROR_CODE in dict(d.headers) for d in dead)
    unreadable = [d for d in dead if UNREADABLE_NAMES in dict(d.headers)]
    assert {dict(d.headers)[UNREADABLE_NAMES] for d in unreadable} >= {b"fffe"}
    assert len(unreadable) == 3
    assert await _metric(worker, "conveyor_unreadable_records_total") == 3
    assert worker.running()
    produced = len(good) + 3 + len(odd)  # one partition: its end offset

    async def committed_to_end() -> bool:
        return await _committed(kafka_bootstrap, m, 1) == {0: produced}

    await until(committed_to_end, "offsets committed past every record", 20, workers.logs)


async def _slow_pair(
    workers: Workers, digits: list[tuple[bytes, int]], bootstrap: str, model: str, n: int
) -> tuple[list[OutgoingRecord], list[str]]:
    records, ids = await setup(bootstrap, model, digits, n, partitions=3)
    await produce(bootstrap, topics_for(model).requests, records)
    return records, ids


# One batch per revoked partition would be 3 x 16 = 48; the bound allows two.
REDELIVERY_BOUND = 96


@pytest.mark.timeout(300)
async def test_slow_model_join_and_leave_redeliver_almost_nothing(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    """A model at 100 ms per batch, max-in-flight at its default: a second worker joins,
    then leaves. Drains finish inside the rebalance timeout: no storm, ~no redelivery."""
    _, ids = await _slow_pair(workers, digits, kafka_bootstrap, model_name, 2400)
    first = workers.start("--max-batch-size", "16", spec=FAULTY, env=SLOW)
    await until_answered(redis_url, ids, 300)
    second = workers.start("--max-batch-size", "16", spec=FAULTY, env=SLOW)
    await until(
        lambda: "partitions assigned: conveyor" in second.log(),
        "the second worker joins",
        60,
        workers.logs,
    )
    await until_answered(redis_url, ids, 1200)
    second.signal(signal.SIGTERM)
    assert second.wait(60) == 0
    row = await tally(
        "slow model (100 ms/batch): join, then leave", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())
    assert row.redelivered <= REDELIVERY_BOUND, workers.logs()[-4000:]
    assert "not finished in" not in first.log()  # every drain finished inside its bound


@pytest.mark.timeout(300)
async def test_worker_stopped_past_its_session_timeout_then_resumed(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    """SIGSTOP one of two slow workers for longer than the session timeout (6 s), then
    SIGCONT: the group moves on without it; what it had in flight is answered again by
    the other worker (redelivered, bounded by its in-flight cap), nothing is lost."""
    _, ids = await _slow_pair(workers, digits, kafka_bootstrap, model_name, 2400)
    frozen = workers.start("--max-batch-size", "16", spec=FAULTY, env=SLOW)
    workers.start("--max-batch-size", "16", spec=FAULTY, env=SLOW)
    await until_answered(redis_url, ids, 400)
    frozen.signal(signal.SIGSTOP)
    await asyncio.sleep(10)
    frozen.signal(signal.SIGCONT)
    row = await tally(
        "slow model: worker SIGSTOPped 10 s, resumed", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())
    # The frozen worker's in-flight cap: 2 s of model time, i.e. 2 s / (100 ms / 16) = 320.
    assert row.redelivered <= 320 + REDELIVERY_BOUND, workers.logs()[-4000:]


async def _topics_with(
    bootstrap: str,
    model: str,
    *,
    results: dict[str, str] | None = None,
    dlq: dict[str, str] | None = None,
) -> None:
    topics = topics_for(model)
    async with admin_for(bootstrap) as admin:
        await admin.create_topics(
            [
                NewTopic(topics.requests, 1, 1),
                NewTopic(topics.results, 1, 1, topic_configs=results or {}),
                NewTopic(topics.dlq, 1, 1, topic_configs=dlq or {}),
            ]
        )


@pytest.mark.timeout(180)
async def test_a_dead_letter_too_large_for_its_topic_is_cut_to_fit(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    await _topics_with(kafka_bootstrap, model_name, dlq={"max.message.bytes": "65536"})
    big = os.urandom(300_000)  # not a PNG: decode_failed, and a copy 4.6x the DLQ's limit
    bad = encode_request(
        big, request_id=f"{model_name}-big", content_type=ContentType.PNG, source="t"
    )
    good = [r for r, _ in digit_requests(digits, 20, prefix=model_name)]
    await produce(kafka_bootstrap, topics_for(model_name).requests, [bad, *good])
    workers.start("--max-batch-size", "8")
    ids = [f"{model_name}-big", *(r.key.decode() for r in good)]
    row = await tally(
        "dead letter over the DLQ topic's limit", kafka_bootstrap, redis_url, model_name, ids, 60
    )
    check(row, workers.logs())
    (letter,) = await read_topic(kafka_bootstrap, topics_for(model_name).dlq, expect=1, timeout=30)
    headers = dict(letter.headers)
    assert int(headers[ORIGINAL_SIZE]) == len(big)
    assert headers[ORIGINAL_SHA256].decode() == hashlib.sha256(big).hexdigest()
    assert 0 < len(letter.value) < 65536
    assert big.startswith(letter.value)


@pytest.mark.timeout(180)
async def test_a_result_too_large_for_the_reply_topic_is_an_error(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    await _topics_with(kafka_bootstrap, model_name, results={"max.message.bytes": "8192"})
    png = digits[0][0]
    records = [
        encode_request(
            png,
            request_id=f"{model_name}-{n}",
            content_type=ContentType.PNG,
            source="t",
            params={"pad": 20_000} if n % 4 == 0 else {},
        )
        for n in range(20)
    ]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    workers.start("--max-batch-size", "8", spec=FAULTY)
    ids = [r.key.decode() for r in records]
    row = await tally(
        "result over the reply topic's limit", kafka_bootstrap, redis_url, model_name, ids, 60
    )
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    for n, request_id in enumerate(ids):
        result = results[request_id]
        if n % 4 == 0:
            assert result.error is not None
            assert result.error.code == ErrorCode.result_too_large
        else:
            assert result.status is Status.ok


@pytest.mark.timeout(120)
async def test_missing_topics_stop_the_worker_at_start(workers: Workers, model_name: str) -> None:
    worker = workers.start()
    code = await asyncio.to_thread(worker.wait, 60)
    assert code == 3, worker.log()
    last = worker.log().strip().splitlines()[-1]
    assert f"conveyor.{model_name}.results" in last
    assert f"conveyor topics create --model {model_name}" in last


@pytest.mark.timeout(180)
async def test_redis_refusing_writes_makes_the_worker_unready_then_exit(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    """A Redis user that may PING but not run the result script (NOPERM): the worker
    says so, goes unready, and exits with status 3 after its grace; nothing is
    committed, so a worker with the right ACL later answers everything."""
    records, ids = await setup(kafka_bootstrap, model_name, digits, 30, partitions=1)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = aioredis.Redis.from_url(redis_url)
    await admin.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~conveyor:result:*", "+ping", "+get"
    )
    try:
        limited = redis_url.replace("redis://", f"redis://{user}:{password}@")
        started = time.monotonic()
        worker = workers.start(
            "--permanent-error-grace-s", "4", "--unready-after-s", "1", redis_url=limited
        )

        async def unready() -> bool:
            port = worker.metrics_port()
            if port is None:
                return False
            try:
                status, body = await http_get(port, "/readyz")
            except OSError:
                return False
            return status == 503 and json.loads(body)["checks"]["results_durable"] != "ok"

        await until(unready, "/readyz fails while results cannot be written", 60, worker.log)
        code = await asyncio.to_thread(worker.wait, 60)
        assert code == 3, worker.log()
        assert time.monotonic() - started < 60
        assert "Redis refused this worker's writes" in worker.log().strip().splitlines()[-1]
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()
    workers.start()
    row = await tally(
        "Redis refuses writes (NOPERM), then fixed", kafka_bootstrap, redis_url, model_name, ids
    )
    check(row, workers.logs())


def _bomb(side: int) -> bytes:
    """An RGBA PNG of side x side pixels (under the 40 MP limit) that compresses to little."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGBA", (side, side), (12, 34, 56, 255)).save(buffer, format="PNG")
    return buffer.getvalue()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


BUDGET_MB = 300
RSS_SLACK_MB = 150  # allocator and interpreter growth beside the decodes themselves


@pytest.mark.timeout(240)
async def test_decode_bombs_in_a_burst_stay_within_the_memory_budget(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    """16 PNGs of 6300x6300 RGBA (each ~200 MB while decoded) with 8 decode threads:
    the budget lets one decode at a time, so RSS grows by at most the budget plus slack."""
    good, good_ids = await setup(kafka_bootstrap, model_name, digits, 5, partitions=1)
    topic = topics_for(model_name).requests
    worker = workers.start(
        "--max-batch-size",
        "8",
        "--decode-threads",
        "8",
        "--decode-memory-mb",
        str(BUDGET_MB),
    )
    await produce(kafka_bootstrap, topic, good)
    await until_answered(redis_url, good_ids, len(good_ids))
    assert worker.proc is not None
    baseline = _rss_mb(worker.proc.pid)
    bomb = _bomb(6300)
    bombs = [
        encode_request(
            bomb, request_id=f"{model_name}-bomb{n}", content_type=ContentType.PNG, source="t"
        )
        for n in range(16)
    ]
    ids = [r.key.decode() for r in bombs]
    await produce(kafka_bootstrap, topic, bombs)
    peak = baseline
    done = asyncio.ensure_future(until_answered(redis_url, ids, len(ids), timeout=180))
    while not done.done():
        peak = max(peak, _rss_mb(worker.proc.pid))
        await asyncio.sleep(0.02)
    await done
    row = await tally(
        "16 decode bombs, 8 threads, 300 MB budget",
        kafka_bootstrap,
        redis_url,
        model_name,
        [*good_ids, *ids],
    )
    check(row, workers.logs())
    results = await redis_results(redis_url, ids)
    assert all(r.status is Status.ok for r in results.values())
    assert peak - baseline < BUDGET_MB + RSS_SLACK_MB, f"RSS grew {peak - baseline:.0f} MB"
