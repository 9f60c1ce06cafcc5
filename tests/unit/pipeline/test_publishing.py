"""Publishing beside the model: a finished batch goes out while the next one runs,
and publishes waiting for their acknowledgements overlap up to ``publishes_in_flight``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from producers.testing import until
from tests.fakes import FakeSource, GatedEcho, HeldSink
from tests.unit.pipeline.harness import make, records


async def test_a_finished_batch_is_published_while_the_next_one_runs() -> None:
    source = FakeSource({0: records(0, 16)})
    model = GatedEcho(hold_after=1)
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        # The first batch ran, the second is held in the model.
        await until(lambda: model.calls >= 2, "a second batch in the model", 5)
        await until(lambda: len(sink.stored) >= model.seen, "the first batch published", 5)
        assert 0 < len(sink.stored) < 16
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == 16


@pytest.mark.parametrize("in_flight", [1, 4])
async def test_publishes_overlap_up_to_the_setting(in_flight: int) -> None:
    """A publish waiting for its acknowledgements does not hold back the next batch's
    results; at most ``publishes_in_flight`` wait at a time, every record answered once."""
    source = FakeSource({p: records(p, 40) for p in range(4)})
    held = HeldSink()
    pipeline, sink = make(source, GatedEcho(), sink=held, publishes_in_flight=in_flight)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    await until(lambda: held.in_progress >= in_flight, f"{in_flight} publishes waiting", 10)
    await asyncio.sleep(0.1)  # batches keep finishing meanwhile
    assert held.most == in_flight
    assert source.committed == {}  # nothing acknowledged, nothing committed
    held.release.set()
    await until(lambda: len(sink.stored) >= 160, "every record answered", 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert len(sink.published_ids()) == 160
    assert source.committed == dict.fromkeys(range(4), 40)
