"""Records in, answers out: every record answered once and in partition order, what
a result carries, the drain at stop, expiry before the model, and fetching paused at
the in-flight cap.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import orjson

from producers.testing import until
from schemas import ErrorCode, Status, decode_result
from tests.fakes import FakeSource, GatedEcho
from tests.unit.pipeline.harness import make, records, run_until
from workers.observe.metrics import Metrics


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
    await until(lambda: model.calls >= 1, "a batch in the model", 5)
    stop.set()
    model.gate.set()
    await asyncio.wait_for(task, 10)
    fetched = source.position[0]
    assert len(sink.stored) == fetched
    assert source.committed[0] == fetched


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
        await until(lambda: True in source.paused_seen, "fetching paused", 5)
        assert source.position[0] <= 16 + 8  # at most one fetch past the cap
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == source.position[0]
