"""Fault scenarios: inject a fault mid-stream, then count what was lost or changed.

``SCENARIOS`` is the table: one row per fault, each a set-up, the fault, the
recovery and what its tally must show (tests/faults/scenes.py). Every row
asserts lost = 0 and duplicate-visible = 0 (exactly-once rows: and no id twice
for a read_committed reader), states its own bounds beside, and adds its row to
the table printed at the end of the run. A new fault is one more row.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from io import BytesIO
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from PIL import Image

from common.s3 import S3Settings, s3_client
from producers import AsyncClient, ClientSettings
from producers.admin import Role, create_model_topics
from producers.testing import (
    Fleet,
    Tally,
    WorkerConfig,
    count_results,
    http_get,
    produce,
    read_results,
    read_topic,
    until,
)
from schemas import ContentType, ErrorCode, OutgoingRecord, Status, consumer_group, encode_request
from schemas.dlq import ERROR_CODE, ORIGINAL_SHA256, ORIGINAL_SIZE, UNREADABLE_NAMES
from tests.faults import faulty
from tests.faults.scenes import (
    EXACTLY_ONCE,
    Scenario,
    Scene,
    Step,
    answered,
    answered_more,
    backlog,
    drain,
    joined,
    kill,
    logs_say,
    mid_stream,
    nothing,
    outage,
    play,
    produce_rest,
    start,
    start_service,
    steps,
    stop_service,
)
from tests.harness import (
    NOTES,
    TEST_WORKER_OPTIONS,
    LocalService,
    digit_requests,
    extra_records_uncommitted,
    kill_inside_a_transaction,
    metrics,
    peak_rss_mb_while,
    rss_mb,
    s3_flags,
)

BATCH_8 = ("--max-batch-size", "8")
FAULTY = faulty.SPEC
SLOW = {"CONVEYOR_TEST_SLOW_MS": "100"}  # 100 ms per batch: a slow model
# One batch per revoked partition would be 3 x 16 = 48; the bound allows two.
REDELIVERY_BOUND = 96


# -- the worker dies, stops or comes and goes ----------------------------------------------


async def no_redelivery(scene: Scene, tally: Tally) -> None:
    assert tally.redelivered == 0, "a clean drain commits everything it answered"


async def second_answers(scene: Scene) -> None:
    """Wait until the newest worker has answered a request of its own."""
    worker_id = scene.worker(-1).default_id

    async def answered_by_it() -> bool:
        results = await read_results(scene.redis_url, scene.ids)
        return any(r.worker == worker_id for r in results.values())

    await until(answered_by_it, "the second worker answers", 120, scene.workers.logs)


SLOW_WORKER = start("--max-batch-size", "16", model=FAULTY, env=SLOW)


async def redeliveries_bounded(scene: Scene, tally: Tally) -> None:
    assert tally.redelivered <= REDELIVERY_BOUND, scene.workers.logs()[-4000:]
    assert "not finished in" not in scene.worker(0).log()  # every drain inside its bound


async def frozen_redeliveries_bounded(scene: Scene, tally: Tally) -> None:
    # The frozen worker's in-flight cap: 2 s of model time, i.e. 2 s / (100 ms / 16) = 320.
    assert tally.redelivered <= 320 + REDELIVERY_BOUND, scene.workers.logs()[-4000:]


async def pause_first(scene: Scene) -> None:
    scene.worker(0).pause()


async def resume_first(scene: Scene) -> None:
    scene.worker(0).resume()


# -- poison in the requests or the model -------------------------------------------------------


async def poison_among_requests(scene: Scene) -> None:
    """63 digits and, in their middle, an image the faulty model fails on: one batch."""
    await backlog(63, partitions=1, produced=0)(scene)
    poison = _request(f"{scene.model}-poison", faulty.poison_png())
    scene.records.insert(31, poison)
    scene.ids.insert(31, poison.key.decode())
    await scene.produce_until()


async def poison_failed_alone(scene: Scene, tally: Tally) -> None:
    poison_id = f"{scene.model}-poison"
    results = await read_results(scene.redis_url, scene.ids)
    failed = {i for i, r in results.items() if r.status is not Status.ok}
    assert failed == {poison_id}
    error = results[poison_id].error
    assert error is not None
    assert error.code == "model_error"
    assert max(r.timings.batch_size for r in results.values() if r.timings) > 1  # it was batched
    dead = await read_topic(scene.bootstrap, scene.topics.dlq, expect=1, timeout_s=30)
    assert [r.key for r in dead] == [poison_id.encode()]


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


def _poison_kinds(m: str, png: bytes) -> dict[str, tuple[OutgoingRecord, Status, str]]:
    """Requests with an id that must each get their own status and error code."""
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat().encode()
    jpeg = b"\xff\xd8\xff\xe0garbage"
    return {
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
            _hand_built(f"{m}-jpeg", jpeg, content_dash_type=b"image/jpeg"),
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
        f"{m}-model": (_hand_built(f"{m}-model", faulty.poison_png()), Status.error, "model_error"),
    }


async def every_poison_kind(scene: Scene) -> None:
    """30 digits with every kind of poison in their middle, two of them without an id."""
    await backlog(30, partitions=1, produced=0)(scene)
    kinds = _poison_kinds(scene.model, scene.digits[0][0])
    png = scene.digits[0][0]
    no_id = [_hand_built(None, png), _hand_built("bad id with spaces", png)]
    good = scene.records
    scene.records = [*good[:15], *(r for r, _, _ in kinds.values()), *no_id, *good[15:]]
    scene.ids += list(kinds)
    await scene.produce_until()


async def each_poison_answered_with_its_code(scene: Scene, tally: Tally) -> None:
    kinds = _poison_kinds(scene.model, scene.digits[0][0])
    results = await read_results(scene.redis_url, scene.ids)
    assert all(results[i].status is Status.ok for i in scene.ids if i not in kinds)
    for request_id, (_record, status, code) in kinds.items():
        result = results[request_id]
        assert result.status is status, result
        assert result.error is not None
        assert result.error.code == code, result
    # Every poison record, with an id or not, has a copy on the dead-letter topic.
    poison_count = len(kinds) - 1 + 2  # the expired request is answered, not poison
    dead = await read_topic(scene.bootstrap, scene.topics.dlq, poison_count, timeout_s=30)
    codes = sorted(dict(r.headers)["conveyor_error_code"].decode() for r in dead)
    expected = sorted([c for _, s, c in kinds.values() if c != "expired"] + ["bad_request"] * 2)
    assert codes == expected


async def all_ok_in_split_batches(scene: Scene, tally: Tally) -> None:
    results = await read_results(scene.redis_url, scene.ids)
    assert all(r.status is Status.ok for r in results.values())
    assert max(r.timings.batch_size for r in results.values() if r.timings) > 4  # really split


async def all_out_of_memory(scene: Scene, tally: Tally) -> None:
    results = await read_results(scene.redis_url, scene.ids)
    assert {r.error.code for r in results.values() if r.error} == {"out_of_memory"}


# -- hostile records ---------------------------------------------------------------------------


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


def _odd_records(m: str, png: bytes) -> list[OutgoingRecord]:
    """A key that is not UTF-8 (valid: keys are not in the contract), a null value, an
    oversized header, and five records of random bytes in every field."""
    rng = random.Random(7)
    odd_key = _request(f"{m}-oddkey", png)
    null = _request(f"{m}-null", png)
    huge = _request(f"{m}-huge", png)
    odd = [
        OutgoingRecord(b"\xff\xfe\x00", odd_key.value, odd_key.headers),
        OutgoingRecord(null.key, None, null.headers),  # type: ignore[arg-type]  # a tombstone
        OutgoingRecord(huge.key, huge.value, [*huge.headers, ("x-big", b"h" * 70_000)]),
    ]
    for _ in range(5):
        names = [rng.randbytes(rng.randint(1, 12)).decode("utf-8", "replace") for _n in range(3)]
        odd.append(
            OutgoingRecord(
                rng.randbytes(rng.randint(0, 20)),
                rng.randbytes(rng.randint(1, 200)),
                [(name, rng.randbytes(rng.randint(0, 40))) for name in names],
            )
        )
    return odd


async def hostile_records(scene: Scene) -> None:
    """Every kind of bad record, between valid ones (one partition, produced in order)."""
    await backlog(40, partitions=1, produced=10)(scene)
    topic, m = scene.topics.requests, scene.model
    # Header names aiokafka's parser refuses (not UTF-8), plain and in a gzip batch.
    for suffix, extra in (("plain", ()), ("gzip", ("-z", "gzip"))):
        header = [b"\xff\xfe=v", *_valid_headers(f"{m}-badname-{suffix}")]
        _kcat(scene.bootstrap, topic, b"refused before it is decoded", header, *extra)
    _kcat(scene.bootstrap, topic, b"\x00\xff" * 50, [b"\xc3\x28=\xff", b"\x80\x81\x82=x"])
    await scene.produce_until(20)
    odd = _odd_records(m, scene.digits[0][0])
    await produce(scene.bootstrap, topic, odd)
    await scene.produce_until()
    scene.measured["produced"] = len(scene.records) + 3 + len(odd)  # the partition's end
    scene.ids += [f"{m}-{name}" for name in ("oddkey", "null", "huge")]
    scene.ids += [f"{m}-badname-plain", f"{m}-badname-gzip"]


async def _committed(bootstrap: str, model: str, topic: str) -> int:
    """The group's committed offset of partition 0 (-1: none)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=consumer_group(model))
    await consumer.start()
    try:
        offset = await consumer.committed(TopicPartition(topic, 0))
        return -1 if offset is None else int(offset)
    finally:
        await consumer.stop()


async def hostile_records_refused_and_passed(scene: Scene, tally: Tally) -> None:
    """The valid ones answered; the bad ones refused and dead-lettered, the unreadable ones
    counted; offsets committed past all of them; the worker still running."""
    m, worker = scene.model, scene.worker(0)
    results = await read_results(scene.redis_url, scene.ids)
    good = [i for i in scene.ids if not i.startswith((f"{m}-badname", f"{m}-null", f"{m}-huge"))]
    assert all(results[i].status is Status.ok for i in good)
    for bad in ("null", "huge", "badname-plain", "badname-gzip"):
        error = results[f"{m}-{bad}"].error
        assert error is not None
        assert error.code == ErrorCode.bad_request
    assert "UTF-8" in results[f"{m}-badname-gzip"].error.message  # type: ignore[union-attr]
    dead = await read_topic(scene.bootstrap, scene.topics.dlq, expect=10, timeout_s=30)
    assert len(dead) == 10  # 3 from kcat, null, huge, 5 random: each copied once
    assert all(ERROR_CODE in dict(d.headers) for d in dead)
    unreadable = [d for d in dead if UNREADABLE_NAMES in dict(d.headers)]
    assert {dict(d.headers)[UNREADABLE_NAMES] for d in unreadable} >= {b"fffe"}
    assert len(unreadable) == 3
    assert (await metrics(worker))["conveyor_unreadable_records_total"] == 3
    assert worker.running()
    end = scene.measured["produced"]

    async def committed_to_end() -> bool:
        return await _committed(scene.bootstrap, m, scene.topics.requests) == end

    await until(committed_to_end, "offsets committed past every record", 20, scene.workers.logs)


# -- what does not fit its topic -------------------------------------------------------------


def _one_partition_topics(configs: dict[Role, dict[str, str]]) -> Step:
    async def run(scene: Scene) -> None:
        settings = ClientSettings(kafka_bootstrap=scene.bootstrap)
        await create_model_topics(settings, scene.model, 1, configs=configs)

    return run


async def big_bad_request(scene: Scene) -> None:
    """A 300 KB request that is no PNG (decode_failed): its copy is 4.6x the DLQ's limit."""
    await _one_partition_topics({"dlq": {"max.message.bytes": "65536"}})(scene)
    big = os.urandom(300_000)
    good, good_ids = digit_requests(scene.digits, 20, prefix=scene.model)
    scene.records = [_request(f"{scene.model}-big", big), *good]
    scene.ids = [f"{scene.model}-big", *good_ids]
    await scene.produce_until()


async def dead_letter_cut_to_fit(scene: Scene, tally: Tally) -> None:
    big = scene.records[0].value
    (letter,) = await read_topic(scene.bootstrap, scene.topics.dlq, expect=1, timeout_s=30)
    headers = dict(letter.headers)
    assert int(headers[ORIGINAL_SIZE]) == len(big)
    assert headers[ORIGINAL_SHA256].decode() == hashlib.sha256(big).hexdigest()
    assert 0 < len(letter.value) < 65536
    assert big.startswith(letter.value)


async def large_results(scene: Scene) -> None:
    """20 requests; every fourth asks for a 20 KB answer, over the reply topic's 8 KB."""
    await _one_partition_topics({"results": {"max.message.bytes": "8192"}})(scene)
    png = scene.digits[0][0]
    scene.records = [
        encode_request(
            png,
            request_id=f"{scene.model}-{n}",
            content_type=ContentType.PNG,
            source="t",
            params={"pad": 20_000} if n % 4 == 0 else {},
        )
        for n in range(20)
    ]
    scene.ids = [r.key.decode() for r in scene.records]
    await scene.produce_until()


async def too_large_is_an_error(scene: Scene, tally: Tally) -> None:
    results = await read_results(scene.redis_url, scene.ids)
    for n, request_id in enumerate(scene.ids):
        result = results[request_id]
        if n % 4 == 0:
            assert result.error is not None
            assert result.error.code == ErrorCode.result_too_large
        else:
            assert result.status is Status.ok


# -- Redis refuses writes ------------------------------------------------------------------------


async def redis_refuses_writes(scene: Scene) -> None:
    """A Redis user that may PING but not run the result script (NOPERM): the worker says
    so, goes unready, and exits with status 3 after its grace, committing nothing."""
    user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = aioredis.Redis.from_url(scene.redis_url)
    await admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["conveyor:result:*"],
        commands=["+ping", "+get"],
    )
    try:
        limited = scene.redis_url.replace("redis://", f"redis://{user}:{password}@")
        started = time.monotonic()
        options = ("--permanent-error-grace-s", "4", "--unready-after-s", "1")
        worker = scene.workers.start(*options, redis_url=limited)

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
        assert await worker.exited(60) == 3, worker.log()
        assert time.monotonic() - started < 60
        assert "Redis refused this worker's writes" in worker.log().strip().splitlines()[-1]
    finally:
        await admin.acl_deluser(user)
        await admin.aclose()


# -- decode bombs --------------------------------------------------------------------------------

BUDGET_MB = 300
RSS_SLACK_MB = 150  # allocator and interpreter growth beside the decodes themselves


def _flat_png(side: int) -> bytes:
    """An RGBA PNG of side x side pixels (under the 40 MP limit) that compresses to little."""
    buffer = BytesIO()
    Image.new("RGBA", (side, side), (12, 34, 56, 255)).save(buffer, format="PNG")
    return buffer.getvalue()


async def warm_worker_with_a_decode_budget(scene: Scene) -> None:
    """A worker with 8 decode threads and a 300 MB budget, warm (5 answers); its RSS then."""
    await backlog(5, partitions=1, produced=0)(scene)
    budget = ("--decode-threads", "8", "--decode-memory-mb", str(BUDGET_MB))
    worker = scene.workers.start(*BATCH_8, *budget)
    await scene.produce_until()
    await answered(5)(scene)
    scene.measured["baseline_mb"] = rss_mb(worker.pid)


async def decode_bombs(scene: Scene) -> None:
    """16 PNGs of 6300x6300 RGBA (each ~200 MB while decoded) at once; the peak RSS."""
    bomb = _flat_png(6300)
    bombs = [_request(f"{scene.model}-bomb{n}", bomb) for n in range(16)]
    scene.records += bombs
    scene.ids += [r.key.decode() for r in bombs]
    await scene.produce_until()
    work = answered(len(scene.ids), timeout_s=180)(scene)
    scene.measured["peak_mb"], _ = await peak_rss_mb_while(scene.worker(0), work)


async def within_the_memory_budget(scene: Scene, tally: Tally) -> None:
    """The budget lets one decode run at a time: RSS grows by at most it plus slack."""
    results = await read_results(scene.redis_url, scene.ids)
    assert all(r.status is Status.ok for r in results.values())
    grown = scene.measured["peak_mb"] - scene.measured["baseline_mb"]
    assert grown < BUDGET_MB + RSS_SLACK_MB, f"RSS grew {grown:.0f} MB"


# -- exactly-once delivery -----------------------------------------------------------------------

EOS_WORKER = start(*EXACTLY_ONCE, *BATCH_8, model=FAULTY, env={"CONVEYOR_TEST_SLOW_MS": "20"})


def kill_in_a_transaction(n: int) -> Step:
    """SIGKILL worker ``n`` while it has a transaction open (tests.harness), noting whether
    the kill left one open."""

    async def run(scene: Scene) -> None:
        left_open = await kill_inside_a_transaction(
            scene.worker(n), scene.bootstrap, scene.topics.results
        )
        scene.facts.append(left_open)

    return run


async def aborted_transactions_noted(scene: Scene, tally: Tally) -> None:
    aborted = await extra_records_uncommitted(scene.bootstrap, scene.model, scene.ids)
    facts = scene.facts
    kills = f", {facts.count(True)} of {len(facts)} kills inside a transaction" if facts else ""
    NOTES.append(
        f"{scene.scenario.name}{kills}: read_uncommitted sees {aborted} extra reply records "
        "from aborted transactions"
    )


async def a_kill_landed_in_a_transaction(scene: Scene, tally: Tally) -> None:
    await aborted_transactions_noted(scene, tally)
    assert any(scene.facts), "no kill landed inside a transaction: the abort path went untested"


# -- the object store --------------------------------------------------------------------------

BUCKET = "payloads"


async def payloads_in_s3(scene: Scene) -> None:
    """600 requests whose payloads are all in S3; a slow worker (~160/s) serving them."""
    async with s3_client(S3Settings.model_validate(scene.s3_options)) as s3:
        await s3.create_bucket(Bucket=BUCKET)
    await backlog(0, partitions=3)(scene)
    settings = ClientSettings.model_validate(
        {
            "kafka_bootstrap": scene.bootstrap,
            "redis_url": scene.redis_url,
            "dataref_store": "s3",
            "dataref_s3_bucket": BUCKET,
            "dataref_threshold_bytes": 1,  # every payload by reference
            **scene.s3_options,
        }
    )
    payloads = [scene.digits[i % len(scene.digits)][0] for i in range(600)]
    async with AsyncClient(settings) as client:
        scene.ids = await client.submit_many(
            payloads, model=scene.model, request_ids=[f"{scene.model}-{i}" for i in range(600)]
        )
    flags = s3_flags(scene.s3_options, BUCKET)
    await start(*BATCH_8, *flags, model=FAULTY, env={"CONVEYOR_TEST_SLOW_MS": "50"})(scene)


async def stalled_count(scene: Scene) -> None:
    scene.measured["stalled"] = await count_results(scene.redis_url, scene.ids)


async def retried_and_all_ok(scene: Scene, tally: Tally) -> None:
    results = await read_results(scene.redis_url, scene.ids)
    assert {r.status for r in results.values()} == {Status.ok}
    assert scene.measured["stalled"] < len(scene.ids)  # the outage did hold requests back
    assert (await metrics(scene.worker(0)))["conveyor_dataref_retries_total"] > 0


def _request(request_id: str, payload: bytes) -> OutgoingRecord:
    return encode_request(payload, request_id=request_id, content_type=ContentType.PNG, source="t")


# -- the table -----------------------------------------------------------------------------------

# Rows look alike by design: each is the data of one scenario (its steps are named above and
# in scenes.py), so a new fault is one more row, not one more copy of a test.
SCENARIOS = [
    Scenario(
        "worker SIGKILL mid-batch, restart",
        setup=steps(backlog(3000), start(*BATCH_8), answered(100)),
        fault=steps(kill(0), mid_stream),
        recovery=start(*BATCH_8),
    ),
    Scenario(
        "worker SIGTERM (drain), restart",
        setup=steps(backlog(3000), start(*BATCH_8), answered(100)),
        fault=steps(drain(0), mid_stream),
        recovery=start(*BATCH_8),
        expect=no_redelivery,
    ),
    Scenario(
        "Redis stopped 10 s mid-run",
        service="redis",
        setup=steps(backlog(3000, produced=1500), start(*BATCH_8), answered(100)),
        fault=steps(stop_service, produce_rest(), outage(10)),  # requests keep arriving
        recovery=start_service,
        expect=logs_say("redis failed"),  # the outage really hit the worker
    ),
    Scenario(
        "Kafka broker stopped and restarted",
        service="kafka",
        setup=steps(backlog(3000, produced=2000), start(*BATCH_8), answered(100)),
        fault=stop_service,
        recovery=steps(start_service, produce_rest()),
        tally_timeout_s=180,
        timeout_s=300,
    ),
    Scenario(
        "second worker joins, then leaves",
        setup=steps(
            backlog(6000, partitions=6, produced=2000),
            start("--max-batch-size", "4"),
            answered(200),
        ),
        # It joins (rebalance 1), answers, then leaves (rebalance 2), draining first.
        fault=steps(
            start("--max-batch-size", "4"), joined(1), produce_rest(4000), second_answers, drain(1)
        ),
        recovery=produce_rest(),  # its partitions must move back
        timeout_s=300,
    ),
    Scenario(
        "one poison item in a batch",
        setup=steps(
            poison_among_requests,
            start("--max-batch-size", "64", "--max-delay-ms", "500", model=FAULTY),
        ),
        fault=nothing,  # in the requests
        expect=poison_failed_alone,
        timeout_s=180,
    ),
    Scenario(
        "every poison kind, mixed with good",
        setup=steps(
            every_poison_kind,
            start(
                "--max-batch-size",
                "16",
                model=FAULTY,
                env={"CONVEYOR_LIMITS__MAX_PAYLOAD_BYTES": "65536"},
            ),
        ),
        fault=nothing,  # in the requests
        expect=each_poison_answered_with_its_code,
        timeout_s=180,
    ),
    Scenario(
        "out-of-memory on batches > 4",
        setup=steps(
            backlog(600),
            start("--max-batch-size", "32", model=FAULTY, env={"CONVEYOR_TEST_OOM_ABOVE": "4"}),
        ),
        fault=nothing,  # in the model
        expect=all_ok_in_split_batches,
        timeout_s=180,
    ),
    Scenario(
        "out-of-memory even alone",
        setup=steps(
            backlog(5, partitions=1),
            start(*BATCH_8, model=FAULTY, env={"CONVEYOR_TEST_OOM_ABOVE": "0"}),
        ),
        fault=nothing,  # in the model
        expect=all_out_of_memory,
        timeout_s=120,
    ),
    Scenario(
        "hostile records interleaved (11 kinds)",
        setup=steps(hostile_records, start(*BATCH_8, model=FAULTY)),
        fault=nothing,  # in the requests
        expect=hostile_records_refused_and_passed,
    ),
    Scenario(
        # Drains finish inside the rebalance timeout: no storm, almost no redelivery.
        "slow model (100 ms/batch): join, then leave",
        setup=steps(backlog(2400), SLOW_WORKER, answered(300)),
        fault=steps(SLOW_WORKER, joined(1), answered(1200), drain(1)),
        expect=redeliveries_bounded,
        timeout_s=300,
    ),
    Scenario(
        # Stopped past the session timeout (6 s): the group moves on without it; what it had
        # in flight is answered again by the other worker, bounded by its in-flight cap.
        "slow model: worker SIGSTOPped 10 s, resumed",
        setup=steps(backlog(2400), SLOW_WORKER, SLOW_WORKER, answered(400)),
        fault=steps(pause_first, outage(10)),
        recovery=resume_first,
        expect=frozen_redeliveries_bounded,
        timeout_s=300,
    ),
    Scenario(
        "dead letter over the DLQ topic's limit",
        setup=steps(big_bad_request, start(*BATCH_8)),
        fault=nothing,  # in the request
        expect=dead_letter_cut_to_fit,
        tally_timeout_s=60,
        timeout_s=180,
    ),
    Scenario(
        "result over the reply topic's limit",
        setup=steps(large_results, start(*BATCH_8, model=FAULTY)),
        fault=nothing,  # in the answers
        expect=too_large_is_an_error,
        tally_timeout_s=60,
        timeout_s=180,
    ),
    Scenario(
        "Redis refuses writes (NOPERM), then fixed",
        setup=backlog(30, partitions=1),
        fault=redis_refuses_writes,
        recovery=start(),  # with the right ACL it answers everything: nothing was committed
        timeout_s=180,
    ),
    Scenario(
        "16 decode bombs, 8 threads, 300 MB budget",
        setup=warm_worker_with_a_decode_budget,
        fault=decode_bombs,
        expect=within_the_memory_budget,
    ),
    Scenario(
        "exactly-once: 2 worker SIGKILLs (read_committed)",
        delivery="exactly-once",
        setup=steps(backlog(3000), EOS_WORKER, answered(300)),
        fault=steps(
            kill_in_a_transaction(0),
            EOS_WORKER,
            EOS_WORKER,
            answered_more(600),
            kill_in_a_transaction(1),
            mid_stream,
        ),
        expect=a_kill_landed_in_a_transaction,
        timeout_s=300,
    ),
    Scenario(
        "exactly-once: broker stopped and restarted (read_committed)",
        delivery="exactly-once",
        service="kafka",
        setup=steps(backlog(3000, produced=2000), start(*EXACTLY_ONCE, *BATCH_8), answered(300)),
        fault=stop_service,
        recovery=steps(start_service, produce_rest()),
        expect=aborted_transactions_noted,
        tally_timeout_s=180,
        timeout_s=300,
    ),
    Scenario(
        "object store (S3) stopped 5 s mid-run",
        service="s3",
        setup=steps(payloads_in_s3, answered(80)),
        fault=steps(stop_service, outage(5), stalled_count),
        recovery=start_service,
        expect=retried_and_all_ok,
        timeout_s=300,
    ),
]


@pytest.fixture
def scene(
    request: pytest.FixtureRequest,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
    tmp_path: Path,
) -> Iterator[Scene]:
    """The scenario's private service first (so its workers stop before it does), then
    its workers, pointed at that service."""
    scenario: Scenario = request.param
    service: LocalService | None = None
    s3_options: dict[str, str] = {}
    if scenario.service is not None:
        service = request.getfixturevalue(f"private_{scenario.service}")
        assert isinstance(service, LocalService)
        if scenario.service == "kafka":
            kafka_bootstrap = service.bootstrap
        elif scenario.service == "redis":
            redis_url = service.url
        else:  # its S3 gateway
            s3_options = request.getfixturevalue("s3_options")
            s3_options = s3_options | {"s3_endpoint_url": f"http://127.0.0.1:{service.port}"}
    config = WorkerConfig(model_name, kafka_bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    with Fleet(config, tmp_path) as fleet:
        yield Scene(
            scenario, model_name, kafka_bootstrap, redis_url, fleet, digits, service, s3_options
        )


@pytest.mark.parametrize(
    "scene",
    [pytest.param(s, id=s.name, marks=pytest.mark.timeout(s.timeout_s)) for s in SCENARIOS],
    indirect=True,
)
async def test_fault(scene: Scene) -> None:
    await play(scene)


async def test_missing_topics_stop_the_worker_at_start(workers: Fleet, model_name: str) -> None:
    worker = workers.start()
    assert await worker.exited(60) == 3, worker.log()
    last = worker.log().strip().splitlines()[-1]
    assert f"conveyor.{model_name}.results" in last
    assert f"conveyor topics create --model {model_name}" in last
