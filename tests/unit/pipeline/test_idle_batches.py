"""A batch closes at once when the source says nothing else is on its way (``idle``), and
waits for its timer while the source is behind or says nothing."""

from __future__ import annotations

import asyncio

from producers.testing import until
from tests.fakes import FakeSource, GatedEcho
from tests.unit.pipeline.harness import closed_batches, make, records
from workers.batching.batcher import CloseReason
from workers.observe.metrics import Metrics

_LONG_DELAY_MS = 30_000.0  # far past every wait of these tests: only idle closes a batch


async def test_a_lone_request_on_a_caught_up_source_closes_its_batch_at_once() -> None:
    source = FakeSource({0: records(0, 1)}, reports_caught_up=True)
    metrics = Metrics("t")
    pipeline, sink = make(source, GatedEcho(), metrics=metrics, max_delay_ms=_LONG_DELAY_MS)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        await until(lambda: len(sink.stored) == 1, "the lone request answered", 10)
        assert closed_batches(metrics, CloseReason.IDLE) == 1
        # Another one later: the source caught up again once it was handed out.
        source.partitions[0].extend(records(0, 1, first=1))
        await until(lambda: len(sink.stored) == 2, "the second answered", 10)
        assert closed_batches(metrics, CloseReason.IDLE) == 2
        assert closed_batches(metrics, CloseReason.TIMEOUT) == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_without_the_source_caught_up_or_with_the_rule_off_the_timer_holds_it() -> None:
    for reports, rule in ((False, True), (True, False)):  # never says it caught up; rule off
        source = FakeSource({0: records(0, 1)}, reports_caught_up=reports)
        metrics = Metrics("t")
        model = GatedEcho()
        pipeline, sink = make(
            source,
            model,
            metrics=metrics,
            max_delay_ms=_LONG_DELAY_MS,
            close_idle_batches=rule,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(pipeline.run(stop))

        def fetched(source: FakeSource = source) -> bool:
            return source.position.get(0, 0) == 1

        try:
            await until(fetched, "the request fetched", 10)
            for _ in range(20):  # fetch rounds of the fake (each yields to the loop)
                await asyncio.sleep(0.01)
            assert (model.calls, closed_batches(metrics)) == (0, 0)  # still waiting
        finally:
            stop.set()  # the drain answers it
            await asyncio.wait_for(task, 10)
        assert len(sink.stored) == 1
        assert closed_batches(metrics, CloseReason.DRAIN) == 1
