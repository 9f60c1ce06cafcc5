"""Freshest-frame mode through the pipeline: waiting frames of a stream are superseded
by newer ones, in frame order, only where the frame or the worker asks for it.
"""

from __future__ import annotations

import asyncio
import threading

from producers.testing import until
from schemas import ContentType, ErrorCode, Status, decode_result, encode_request
from tests.fakes import TOPIC, FakeRecord, FakeSink, FakeSource, GatedEcho, Key
from tests.unit.pipeline.harness import make
from workers.observe.metrics import Metrics
from workers.pipeline import Pipeline


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
        await until(lambda: model.calls >= 1, "the first batch in the model", 5)
        await until(  # everything fetched while the model is held
            lambda: all(source.position.get(key, 0) >= n for key, n in fetched.items()),
            f"{fetched} fetched",
            5,
        )
        model.gate.set()
        await until(lambda: len(sink.stored) >= sum(fetched.values()), "every frame answered", 10)
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
