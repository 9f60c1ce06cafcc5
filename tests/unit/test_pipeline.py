"""The real pipeline, in-process, behind a fake record source and a fake result sink.

The model is a tiny handler whose forward can be held (a gate) or fail on a poison
value, so the tests see ordering, draining, revocation, expiry, bisection and
backpressure without Kafka, Redis or timing luck.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from producers.testing import until
from schemas import ContentType, ErrorCode, Status, decode_result, encode_request
from tests.fakes import (
    POISON,
    TOPIC,
    FakeRecord,
    FakeSink,
    FakeSource,
    FakeState,
    FakeStore,
    FakeTransactions,
    GatedEcho,
    HeldSink,
    Key,
    RevokedOnFetch,
)
from workers.batching.batcher import CloseReason
from workers.config.worker import WorkerSettings
from workers.intake.admission import Admission, RequestState
from workers.intake.payload_stores import PayloadStore
from workers.intake.references import Claims
from workers.model.runner import ModelRunner
from workers.observe.metrics import Metrics
from workers.pipeline import Pipeline
from workers.publish.answers import Answers
from workers.types import (
    Committed,
    PartitionCommit,
    TransactionalSink,
)


def records(
    partition: int, count: int, *, first: int = 0, deadline: datetime | None = None
) -> list[FakeRecord]:
    out = []
    for n in range(count):
        rid = f"p{partition}-{first + n}"
        value = bytes([POISON if rid == "p0-13" else n % 200 + 1])
        record = encode_request(
            value, request_id=rid, content_type=ContentType.TEXT, source="t", deadline=deadline
        )
        out.append(
            FakeRecord(TOPIC, partition, first + n, 0, record.key, record.value, record.headers)
        )
    return out


def make(
    source: FakeSource,
    model: GatedEcho,
    *,
    stores: Mapping[str, PayloadStore] | None = None,
    state: RequestState | None = None,
    transactions: TransactionalSink | None = None,
    metrics: Metrics | None = None,
    sink: FakeSink | None = None,
    **settings: Any,
) -> tuple[Pipeline, FakeSink]:
    options = {"max_batch_size": 8, "max_delay_ms": 1.0, "decode_threads": 1, **settings}
    s = WorkerSettings(model="tests:Echo", model_name="t", device="cpu", **options)
    sink = sink or FakeSink()
    runner = ModelRunner(model, device="cpu")
    answers = Answers("t", model.version, "w1", max_result_bytes=1 << 20)
    metrics = metrics or Metrics("t")
    claims = None if stores is None else Claims.from_settings(s, metrics, stores)
    admission = None if state is None else Admission(state, metrics)
    pipeline = Pipeline(
        s,
        source,
        sink,
        runner,
        answers,
        metrics,
        claims=claims,
        admission=admission,
        transactions=transactions,
    )
    return pipeline, sink


def closed_batches(metrics: Metrics, *reasons: CloseReason) -> float:
    """Batches of model "t" closed so far for ``reasons`` (none given: for any reason)."""
    read = metrics.registry.get_sample_value
    return sum(
        read("conveyor_batches_total", {"model": "t", "reason": reason}) or 0.0
        for reason in reasons or tuple(CloseReason)
    )


async def run_until(pipeline: Pipeline, done: Any, timeout: float = 10) -> None:
    """Run the pipeline until ``done()`` holds, then stop it and wait for the drain."""
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)


async def test_every_record_is_answered_once_in_partition_order() -> None:
    source = FakeSource({0: records(0, 40), 1: records(1, 40)})
    model = GatedEcho()
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics)
    await run_until(pipeline, lambda: len(sink.stored) == 80)
    ids = sink.published_ids()
    assert sorted(ids) == sorted(f"p{p}-{n}" for p in (0, 1) for n in range(40))
    assert len(ids) == 80  # once each
    for p in (0, 1):
        ok = [i for i in ids if i.startswith(f"p{p}-") and i != "p0-13"]
        assert ok == sorted(ok, key=lambda i: int(i.split("-")[1]))
    assert source.committed == {0: 40, 1: 40}
    # Bisection: the poison item failed alone, everything else is ok.
    assert sink.status("p0-13") is Status.error
    assert decode_result(sink.stored["p0-13"]).error.code == ErrorCode.model_error  # type: ignore[union-attr]
    assert sum(sink.status(i) is Status.ok for i in sink.stored) == 79
    assert metrics.totals().answered == 80


async def test_results_carry_their_reply_topic_partition_and_timings() -> None:
    source = FakeSource({2: records(2, 3)})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    box = sink.outboxes[0]
    assert box.partitions[0] == 2
    assert box.reply_to[0] is None
    doc = orjson.loads(box.values[0])
    timings = doc["timings"]
    assert timings["batch_size"] >= 1
    assert timings["received_ms"] <= timings["batch_start_ms"] <= timings["finished_ms"]
    assert timings["finished_ms"] <= timings["published_ms"]
    assert dict(box.headers[0])["ce_subject"] == box.ids[0].encode()


async def test_stop_drains_what_was_fetched() -> None:
    source = FakeSource({0: records(0, 30)})
    model = GatedEcho()
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    await asyncio.to_thread(model.entered.acquire, True, 5)  # a batch is in the model
    stop.set()
    model.gate.set()
    await asyncio.wait_for(task, 10)
    fetched = source.position[0]
    assert len(sink.stored) == fetched
    assert source.committed[0] == fetched


async def test_a_finished_batch_is_published_while_the_next_one_runs() -> None:
    source = FakeSource({0: records(0, 16)})
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        for _ in range(2):  # the first batch ran, the second is held in the model
            assert await asyncio.to_thread(model.entered.acquire, True, 5)
        async with asyncio.timeout(5):
            while len(sink.stored) < model.seen:
                await asyncio.sleep(0.01)
        assert 0 < len(sink.stored) < 16
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == 16


@pytest.mark.parametrize(("stage_batches", "closed"), [(1, 1), (2, 2)])
async def test_while_the_model_stage_is_full_no_further_batch_closes(
    stage_batches: int, closed: int
) -> None:
    source = FakeSource({0: records(0, 24)})
    model = GatedEcho()
    model.gate = threading.Event()  # the first batch stays in the model
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics, stage_batches=stage_batches)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))

    try:
        assert await asyncio.to_thread(model.entered.acquire, True, 5)
        await asyncio.sleep(0.2)  # time enough for more batches, were there room
        assert closed_batches(metrics) == closed
        model.gate.set()
        await until(lambda: len(sink.stored) == 24, "every request answered", 5)
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(("partial", "closed"), [(1, 1), (2, 2)])
async def test_beyond_its_share_of_partial_batches_the_stage_takes_only_a_full_one(
    partial: int, closed: int
) -> None:
    source = FakeSource({0: records(0, 1)})
    model = GatedEcho()
    model.gate = threading.Event()  # every batch stays in the model until the end
    metrics = Metrics("t")
    pipeline, sink = make(
        source, model, metrics=metrics, stage_batches=4, stage_partial_batches=partial
    )
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))

    try:
        assert await asyncio.to_thread(model.entered.acquire, True, 5)  # one in the stage
        source.partitions[0].extend(records(0, 3, first=1))
        await asyncio.sleep(0.2)  # the three timed out long ago
        assert closed_batches(metrics) == closed
        source.partitions[0].extend(records(0, 8, first=4))  # a full batch's worth, at least
        await until(lambda: closed_batches(metrics, CloseReason.FULL) == 1, "a full batch", 5)
        assert closed_batches(metrics) == closed + 1
        model.gate.set()
        await until(lambda: len(sink.stored) == 12, "every request answered", 5)
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_expired_requests_never_reach_the_model() -> None:
    past = datetime.now(UTC) - timedelta(seconds=5)
    source = FakeSource({0: records(0, 5, deadline=past) + records(0, 5, first=5)})
    model = GatedEcho()
    pipeline, sink = make(source, model)
    await run_until(pipeline, lambda: len(sink.stored) == 10)
    assert [sink.status(f"p0-{n}") for n in range(10)] == [Status.expired] * 5 + [Status.ok] * 5
    assert model.seen == 5
    assert not any(box.dead for box in sink.outboxes)  # expiry is not a dead letter


async def test_backpressure_pauses_fetching_at_the_in_flight_cap() -> None:
    source = FakeSource({0: records(0, 200)})
    model = GatedEcho()
    model.gate = threading.Event()
    pipeline, sink = make(source, model, max_in_flight=16)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while True not in source.paused_seen:
                await asyncio.sleep(0.01)
        assert source.position[0] <= 16 + 8  # at most one fetch past the cap
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == source.position[0]


async def test_revoke_drains_commits_and_forgets_the_partition() -> None:
    source = FakeSource({0: records(0, 24), 1: records(1, 24)})
    model = GatedEcho()
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while source.position.get(1, 0) == 0:
                await asyncio.sleep(0.001)
        fetched = source.position[1]
        await source.revoke(1)
        # Everything fetched from partition 1 was answered before it went away.
        assert all(f"p1-{n}" in sink.stored for n in range(fetched))
        assert source.committed[1] == fetched
        assert metrics.totals().handed_back == 0
        async with asyncio.timeout(5):
            while len([i for i in sink.stored if i.startswith("p0-")]) < 24:
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_revocation_drains_records_fetched_but_not_yet_taken() -> None:
    source = RevokedOnFetch({0: records(0, 8), 1: records(1, 8)})
    pipeline, sink = make(source, GatedEcho())
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while source.revoking is None:
                await asyncio.sleep(0.001)
            await source.revoking
        fetched = source.position[1]
        assert fetched > 0
        assert all(f"p1-{n}" in sink.stored for n in range(fetched))
        assert source.committed[1] == fetched
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_drain_past_its_bound_hands_the_rest_back_uncommitted() -> None:
    source = FakeSource({0: records(0, 20)})
    model = GatedEcho()
    model.gate = threading.Event()
    metrics = Metrics("t")
    pipeline, _sink = make(
        source, model, metrics=metrics, max_drain_ms=200, rebalance_timeout_ms=5_200
    )
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        assert await asyncio.to_thread(model.entered.acquire, True, 5)
        await source.revoke(0)  # the model is stuck: the drain gives up after 200 ms
        assert metrics.totals().handed_back > 0
        assert 0 not in source.committed  # nothing was finished, nothing committed
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(
    ("headers_change", "code"),
    [
        (lambda h: [x for x in h if x[0] != "ce_source"], ErrorCode.bad_request),
        (lambda h: [*h, ("ce_params", b"[1]")], ErrorCode.bad_request),
        (
            lambda h: [(n, b"image/gif" if n == "content-type" else v) for n, v in h],
            ErrorCode.unsupported_media_type,
        ),
    ],
)
async def test_bad_records_get_error_results_and_dead_letters(
    headers_change: Any, code: ErrorCode
) -> None:
    good = records(0, 3)
    bad = good[1]
    good[1] = FakeRecord(
        bad.topic, 0, bad.offset, 0, bad.key, bad.value, headers_change(list(bad.headers))
    )
    source = FakeSource({0: good})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    result = decode_result(sink.stored["p0-1"])
    assert result.error is not None
    assert result.error.code == code
    dead = [letter for box in sink.outboxes for letter in box.dead]
    assert len(dead) == 1
    assert dead[0].value == bad.value
    assert source.committed == {0: 3}


async def test_error_results_go_to_ce_replyto_with_a_checked_traceparent() -> None:
    good = records(0, 3)
    trace = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for n, traceparent in ((0, trace), (1, b"not-a-trace-context")):
        r = good[n]
        headers = [h for h in r.headers if h[0] != "ce_source"]  # a bad request
        headers += [("ce_replyto", b"my.replies"), ("traceparent", traceparent)]
        good[n] = FakeRecord(r.topic, 0, r.offset, 0, r.key, r.value, headers)
    source = FakeSource({0: good})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    sent = {
        request_id: (reply_to, dict(headers))
        for box in sink.outboxes
        for request_id, reply_to, headers in zip(box.ids, box.reply_to, box.headers, strict=True)
    }
    assert sent["p0-0"][0] == "my.replies"
    assert sent["p0-0"][1]["traceparent"] == trace
    assert sent["p0-1"][0] == "my.replies"
    assert "traceparent" not in sent["p0-1"][1]  # malformed: dropped, as W3C says
    assert sent["p0-2"][0] is None


# -- priority lanes --------------------------------------------------------------------------

HIGH = f"{TOPIC}.high"


def lane_records(topic: str, partition: int, count: int, prefix: str) -> list[FakeRecord]:
    out = []
    for n in range(count):
        record = encode_request(
            bytes([n % 200 + 1]),
            request_id=f"{prefix}-{n}",
            content_type=ContentType.TEXT,
            source="t",
        )
        out.append(FakeRecord(topic, partition, n, 0, record.key, record.value, record.headers))
    return out


async def test_a_high_lane_request_overtakes_a_low_lane_backlog() -> None:
    source = FakeSource({0: lane_records(TOPIC, 0, 200, "low")})
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics, lanes="high:8", max_in_flight=64)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        # The low lane fills the in-flight budget and pauses; the high lane does not.
        async with asyncio.timeout(5):
            while TOPIC not in source.paused:
                await asyncio.sleep(0.01)
        assert HIGH not in source.paused
        source.partitions[(HIGH, 0)] = lane_records(HIGH, 0, 3, "high")
        async with asyncio.timeout(5):
            while source.position.get((HIGH, 0), 0) < 3:
                await asyncio.sleep(0.01)
        answered_before = len(sink.published_ids())  # the model is held meanwhile
        model.gate.set()
        async with asyncio.timeout(5):
            while not all(f"high-{n}" in sink.stored for n in range(3)):
                await asyncio.sleep(0.001)
        published = sink.published_ids()
        last_high = max(published.index(f"high-{n}") for n in range(3))
        overtaken_by = [i for i in published[answered_before:last_high] if i.startswith("low-")]
        # Ahead of the high requests: the batch on the model and the one queued behind it.
        assert len(overtaken_by) <= 2 * 8
        async with asyncio.timeout(10):
            while sum(1 for i in sink.stored if i.startswith("low-")) < 200:
                await asyncio.sleep(0.01)
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert source.committed == {0: 200, (HIGH, 0): 3}
    text = metrics.render().decode()
    assert 'conveyor_lane_end_to_end_seconds_count{lane="high",model="t"} 3.0' in text
    assert 'conveyor_lane_queue_wait_seconds_count{lane="default",model="t"} 200.0' in text


async def test_a_saturated_high_lane_still_lets_the_low_lane_through() -> None:
    source = FakeSource(
        {
            (HIGH, 0): lane_records(HIGH, 0, 400, "high"),
            0: lane_records(TOPIC, 0, 40, "low"),
        }
    )
    pipeline, sink = make(source, GatedEcho(), lanes="high:3")
    await run_until(pipeline, lambda: sum(1 for i in sink.stored if i.startswith("low-")) == 40)
    published = sink.published_ids()
    last_low = max(published.index(f"low-{n}") for n in range(40))
    high_before = sum(1 for i in published[:last_low] if i.startswith("high-"))
    # One batch in four is the low lane's while both have work (weights 3:1): its five
    # batches of 8 went out with at most three high batches before each, one more
    # running when the first low items came.
    assert high_before <= (3 * 5 + 1) * 8


# -- freshest-frame mode ---------------------------------------------------------------------


def frames(
    partition: int, stream: str, count: int, supersede: bool | None = True, first: int = 0
) -> list[FakeRecord]:
    out = []
    for n in range(first, first + count):
        record = encode_request(
            bytes([n % 200 + 1]),
            request_id=f"{stream}:{n}",
            content_type=ContentType.TEXT,
            source="t",
            stream=stream,
            seq=n,
            supersede=supersede,
        )
        out.append(FakeRecord(TOPIC, partition, n, 0, record.key, record.value, record.headers))
    return out


def outcome_order(sink: FakeSink, stream: str) -> list[tuple[int, Status]]:
    """(seq, status) of the stream's answers, in the order they were published."""
    return [
        (int(i.rsplit(":", 1)[1]), decode_result(v).status)
        for box in sink.outboxes
        for i, v in zip(box.ids, box.values, strict=True)
        if i.startswith(f"{stream}:")
    ]


async def serve_held(
    pipeline: Pipeline,
    source: FakeSource,
    model: GatedEcho,
    sink: FakeSink,
    fetched: dict[Key, int],
) -> None:
    """Run ``pipeline`` with ``model`` held after its first item until every partition in
    ``fetched`` is read that far, then release it and wait for every fetched answer."""
    assert model.gate is not None
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        assert await asyncio.to_thread(model.entered.acquire, True, 5)
        async with asyncio.timeout(5):  # everything fetched while the model is held
            while any(source.position.get(key, 0) < n for key, n in fetched.items()):
                await asyncio.sleep(0.01)
        model.gate.set()
        async with asyncio.timeout(10):
            while len(sink.stored) < sum(fetched.values()):
                await asyncio.sleep(0.01)
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_waiting_frames_are_superseded_by_newer_ones_and_order_is_kept() -> None:
    source = FakeSource({0: frames(0, "cam", 60), 1: frames(1, "other", 60)})
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics)
    await serve_held(pipeline, source, model, sink, {0: 60, 1: 60})
    for stream in ("cam", "other"):
        answers = outcome_order(sink, stream)
        assert sorted(seq for seq, _ in answers) == list(range(60))  # every frame, once
        ok = [seq for seq, status in answers if status is Status.ok]
        assert ok == sorted(ok)  # the answered frames in frame order
        assert ok[-1] == 59  # the newest frame is always answered
        superseded = [seq for seq, status in answers if status is Status.expired]
        assert len(superseded) >= 40  # most frames never reached the model
        assert set(ok) | set(superseded) == set(range(60))
    result = decode_result(sink.stored["cam:0" if "cam:0" in sink.stored else "cam:1"])
    assert result.status in (Status.ok, Status.expired)
    skipped = decode_result(sink.stored[f"cam:{superseded[0]}"])
    assert skipped.error is not None
    assert skipped.error.code == ErrorCode.superseded
    assert model.seen < 120 - 80
    assert not any(box.dead for box in sink.outboxes)  # superseded is not a dead letter
    assert "conveyor_superseded_total" in metrics.render().decode()


async def test_frames_are_all_answered_without_the_mode() -> None:
    source = FakeSource(
        {0: frames(0, "cam", 30, supersede=None) + frames(0, "cam2", 10, supersede=False, first=30)}
    )
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    await serve_held(pipeline, source, model, sink, {0: 40})
    assert all(sink.status(i) is Status.ok for i in sink.stored)
    assert model.seen == 40


async def test_the_worker_setting_turns_the_mode_on_for_frames_that_do_not_say() -> None:
    source = FakeSource(
        {0: frames(0, "cam", 30, supersede=None) + frames(0, "keep", 10, supersede=False, first=30)}
    )
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    pipeline, sink = make(source, model, supersede_frames=True)
    await serve_held(pipeline, source, model, sink, {0: 40})
    statuses = {i: sink.status(i) for i in sink.stored}
    assert any(s is Status.expired for i, s in statuses.items() if i.startswith("cam:"))
    assert all(s is Status.ok for i, s in statuses.items() if i.startswith("keep:"))


# -- exactly-once delivery -------------------------------------------------------------------


def check_exactly_once(txns: FakeTransactions, partitions: dict[int, int]) -> None:
    """Every request committed once, and each transaction covers exactly the records
    between its partition's previous position and its own."""
    ids = txns.ids()
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(
        f"p{p}-{n}" for p, count in partitions.items() for n in range(count)
    )
    position = dict.fromkeys(partitions, 0)
    for part in txns.committed:
        p = part.partition[1]
        offsets = sorted(int(i.split("-")[1]) for i in part.outbox.ids)
        assert offsets == list(range(position[p], part.position))
        position[p] = part.position
    assert position == partitions


async def test_exactly_once_commits_each_partition_in_order_with_its_position() -> None:
    bad = records(0, 30)
    r = bad[3]  # a refusal, answered long before the records around it
    bad[3] = FakeRecord(
        r.topic, 0, r.offset, 0, r.key, r.value, [h for h in r.headers if h[0] != "ce_source"]
    )
    source = FakeSource({0: bad, 1: records(1, 30)})
    txns = FakeTransactions(source)
    metrics = Metrics("t")
    pipeline, sink = make(source, GatedEcho(), metrics=metrics, transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 60)
    check_exactly_once(txns, {0: 30, 1: 30})
    assert sink.outboxes == []  # nothing went the at-least-once way
    dead = [letter for part in txns.committed for letter in part.outbox.dead]
    assert len(dead) == 1 + 1  # the bad request and the poison item, inside transactions
    assert metrics.totals().answered == 60


async def test_a_lost_transaction_reads_its_partition_again_from_the_committed_position() -> None:
    source = FakeSource({0: records(0, 40, first=0), 1: records(1, 40)})
    txns = FakeTransactions(source, lose={(TOPIC, 0)})
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 80)
    assert source.restarted == [(TOPIC, 0)]
    check_exactly_once(txns, {0: 40, 1: 40})


async def test_exactly_once_revoke_closes_the_partition_after_its_drain() -> None:
    source = FakeSource({0: records(0, 24), 1: records(1, 24)})
    txns = FakeTransactions(source)
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while source.position.get(1, 0) == 0:
                await asyncio.sleep(0.001)
        fetched = source.position[1]
        await source.revoke(1)
        assert txns.closed == [(TOPIC, 1)]
        assert source.committed[1] == fetched  # drained and committed in transactions
        async with asyncio.timeout(5):
            while source.committed.get(0) != 24:
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


# -- payloads by reference, cancellation, status --------------------------------------


def referenced(partition: int, first: int, count: int) -> list[FakeRecord]:
    """Requests whose one-byte payloads are stored as conveyor:data:<id>."""
    out = []
    for n in range(first, first + count):
        rid = f"p{partition}-{n}"
        record = encode_request(
            b"",
            request_id=rid,
            content_type=ContentType.TEXT,
            source="t",
            dataref=f"redis:conveyor:data:{rid}",
        )
        out.append(FakeRecord(TOPIC, partition, n, 0, record.key, record.value, record.headers))
    return out


async def test_referenced_payloads_are_served_in_partition_order_among_inline_ones() -> None:
    mixed = records(0, 4) + referenced(0, 4, 4) + records(0, 4, first=8)
    stored = {f"conveyor:data:p0-{n}": bytes([100 + n]) for n in range(4, 8)}
    del stored["conveyor:data:p0-6"]  # one of them was never stored
    source = FakeSource({0: mixed})
    pipeline, sink = make(source, GatedEcho(), stores={"redis": FakeStore(stored)})
    await run_until(pipeline, lambda: len(sink.stored) == 12)
    outputs = {i: decode_result(v).outputs for i, v in sink.stored.items()}
    assert [outputs[f"p0-{n}"] for n in (4, 5, 7)] == [104, 105, 107]  # the stored bytes
    error = decode_result(sink.stored["p0-6"]).error
    assert error is not None
    assert error.code == ErrorCode.dataref_missing
    ok = [i for i in sink.published_ids() if i != "p0-6"]
    assert ok == sorted(ok, key=lambda i: int(i.split("-")[1]))
    assert source.committed == {0: 12}


async def test_a_worker_without_stores_refuses_references() -> None:
    source = FakeSource({0: referenced(0, 0, 2)})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 2)
    assert {decode_result(v).error.code for v in sink.stored.values()} == {  # type: ignore[union-attr]
        ErrorCode.dataref_denied
    }


async def test_cancelled_requests_are_answered_without_reaching_the_model() -> None:
    source = FakeSource({0: records(0, 40, first=100)})
    model = GatedEcho()
    state = FakeState(cancelled={f"p0-{n}" for n in range(100, 140, 2)})
    metrics = Metrics("t")
    pipeline, sink = make(source, model, state=state, metrics=metrics)
    await run_until(pipeline, lambda: len(sink.stored) == 40)
    results = {i: decode_result(v) for i, v in sink.stored.items()}
    cancelled = {i for i, r in results.items() if r.error is not None}
    assert cancelled == state.cancelled
    assert {results[i].error.code for i in cancelled} == {ErrorCode.cancelled}  # type: ignore[union-attr]
    assert {results[i].status for i in cancelled} == {Status.error}
    assert model.seen == 20
    assert not any(box.dead for box in sink.outboxes)
    # One call per batch of at most max_batch_size (8) requests, not one per request.
    assert max(state.sizes) <= 8
    assert len(state.sizes) < 40
    assert b'conveyor_cancelled_total{model="t"} 20.0' in metrics.render()


async def test_results_carry_the_attempt_the_state_counted() -> None:
    source = FakeSource({0: records(0, 3, first=100)})
    state = FakeState(attempts={"p0-101": 2})  # started twice before, by workers that died
    pipeline, sink = make(source, GatedEcho(), state=state)
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    assert [decode_result(sink.stored[f"p0-{n}"]).attempt for n in (100, 101, 102)] == [1, 3, 1]


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("Redis is down"),
        # uvloop's, for a write to a connection Redis closed as the client reconnected
        RuntimeError("unable to perform operation on <TCPTransport>; the handler is closed"),
    ],
)
async def test_a_state_store_that_fails_lets_the_batch_run(error: Exception) -> None:
    class Down:
        async def start(self, ids: Sequence[str]) -> list[int]:
            raise error

    source = FakeSource({0: records(0, 5, first=100)})
    metrics = Metrics("t")
    pipeline, sink = make(source, GatedEcho(), state=Down(), metrics=metrics)
    await run_until(pipeline, lambda: len(sink.stored) == 5)
    assert {decode_result(v).status for v in sink.stored.values()} == {Status.ok}
    assert b"conveyor_admission_failures_total" in metrics.render()


async def test_a_failed_device_stops_the_worker_with_its_batch_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poison's failure left the device broken: the worker stops (DeviceLost, exit
    status 7) instead of answering the batch, or any later one, with errors; the poison's
    offset is not committed, so another member serves it."""
    import workers.model.inference
    from workers.types import DeviceLost

    monkeypatch.setattr(
        workers.model.inference, "device_error", lambda device: RuntimeError("CUDA error: lost")
    )
    source = FakeSource({0: records(0, 40)})
    pipeline, sink = make(source, GatedEcho())
    with pytest.raises(DeviceLost, match="CUDA error: lost"):
        await asyncio.wait_for(pipeline.run(asyncio.Event()), 10)
    assert "p0-13" not in sink.stored
    assert all(sink.status(i) is Status.ok for i in sink.stored)
    assert source.committed.get(0, 0) <= 13


@pytest.mark.parametrize("in_flight", [1, 4])
async def test_publishes_overlap_up_to_the_setting(in_flight: int) -> None:
    """A publish waiting for its acknowledgements does not hold back the next batch's
    results; at most ``publishes_in_flight`` wait at a time, every record answered once."""
    source = FakeSource({p: records(p, 40) for p in range(4)})
    held = HeldSink()
    pipeline, sink = make(source, GatedEcho(), sink=held, publishes_in_flight=in_flight)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    async with asyncio.timeout(10):
        while held.in_progress < in_flight:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # batches keep finishing meanwhile
    assert held.most == in_flight
    assert source.committed == {}  # nothing acknowledged, nothing committed
    held.release.set()
    async with asyncio.timeout(10):
        while len(sink.stored) < 160:
            await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert len(sink.published_ids()) == 160
    assert source.committed == dict.fromkeys(range(4), 40)


async def test_a_configuration_error_of_an_overlapping_publish_ends_the_worker() -> None:
    from workers.publish.errors import PublishConfigError

    held = HeldSink(fail_with=PublishConfigError("Redis refused this worker's writes"))
    pipeline, _ = make(FakeSource({0: records(0, 40)}), GatedEcho(), sink=held)
    held.release.set()
    with pytest.raises(PublishConfigError, match="refused"):  # itself, not in a group
        await asyncio.wait_for(pipeline.run(asyncio.Event()), 10)


async def test_exactly_once_transactions_never_overlap() -> None:
    source = FakeSource({p: records(p, 30) for p in range(3)})

    @dataclass
    class Counted(FakeTransactions):
        in_progress: int = 0
        most: int = 0

        async def publish(self, parts: Sequence[PartitionCommit]) -> tuple[list[Committed], int]:
            self.in_progress += 1
            self.most = max(self.most, self.in_progress)
            try:
                await asyncio.sleep(0.005)
                return await super().publish(parts)
            finally:
                self.in_progress -= 1

    txns = Counted(source)
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 90)
    check_exactly_once(txns, dict.fromkeys(range(3), 30))
    assert txns.most == 1
