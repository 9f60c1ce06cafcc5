"""Priority lanes through the pipeline: a high-lane request overtakes a low-lane
backlog, and a saturated high lane still lets the low lane through.
"""

from __future__ import annotations

import asyncio
import threading

from producers.testing import until
from schemas import ContentType, encode_request
from tests.fakes import TOPIC, FakeRecord, FakeSource, GatedEcho
from tests.unit.pipeline.harness import make, run_until
from workers.observe.metrics import Metrics

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
        await until(lambda: TOPIC in source.paused, "the low lane paused", 5)
        assert HIGH not in source.paused
        source.partitions[(HIGH, 0)] = lane_records(HIGH, 0, 3, "high")
        await until(lambda: source.position.get((HIGH, 0), 0) >= 3, "the high lane fetched", 5)
        answered_before = len(sink.published_ids())  # the model is held meanwhile
        model.gate.set()
        await until(
            lambda: all(f"high-{n}" in sink.stored for n in range(3)), "the high lane answered", 5
        )
        published = sink.published_ids()
        last_high = max(published.index(f"high-{n}") for n in range(3))
        overtaken_by = [i for i in published[answered_before:last_high] if i.startswith("low-")]
        # Ahead of the high requests: the batch on the model and the one queued behind it.
        assert len(overtaken_by) <= 2 * 8
        await until(
            lambda: sum(1 for i in sink.stored if i.startswith("low-")) >= 200,
            "the low lane answered",
            10,
        )
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
