"""The model stage's bounds: while it holds its batches no further batch closes, and
beyond its share of partial batches only a full one joins them.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from producers.testing import until
from tests.fakes import FakeSource, GatedEcho
from tests.unit.pipeline.harness import closed_batches, make, records
from workers.batching.batcher import CloseReason
from workers.observe.metrics import Metrics


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
        await until(lambda: model.calls >= 1, "a batch in the model", 5)
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
        await until(lambda: model.calls >= 1, "one batch in the stage", 5)
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
