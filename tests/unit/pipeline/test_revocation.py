"""A revoked partition: its work in flight is drained and committed before it goes,
records fetched but not yet taken included; past the drain's bound the rest is handed
back uncommitted.
"""

from __future__ import annotations

import asyncio
import threading

from producers.testing import until
from tests.fakes import FakeSource, GatedEcho, RevokedOnFetch
from tests.unit.pipeline.harness import make, records, revoke_in_flight
from workers.observe.metrics import Metrics


async def test_revoke_drains_commits_and_forgets_the_partition() -> None:
    source = FakeSource({0: records(0, 24), 1: records(1, 24)})
    model = GatedEcho()
    model.gate = threading.Event()  # what was fetched is in flight when the revocation comes
    metrics = Metrics("t")
    pipeline, sink = make(source, model, metrics=metrics)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        fetched = await revoke_in_flight(source, model, 1)
        # Everything fetched from partition 1 was answered before it went away.
        assert all(f"p1-{n}" in sink.stored for n in range(fetched))
        assert source.committed[1] == fetched
        assert metrics.totals().handed_back == 0
        await until(
            lambda: len([i for i in sink.stored if i.startswith("p0-")]) >= 24,
            "partition 0 answered",
            5,
        )
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_revocation_drains_records_fetched_but_not_yet_taken() -> None:
    source = RevokedOnFetch({0: records(0, 8), 1: records(1, 8)})
    pipeline, sink = make(source, GatedEcho())
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        await until(lambda: source.revoking is not None, "the revocation begun", 5)
        assert source.revoking is not None
        await asyncio.wait_for(source.revoking, 5)
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
        await until(lambda: model.calls >= 1, "a batch in the model", 5)
        await source.revoke(0)  # the model is stuck: the drain gives up after 200 ms
        assert metrics.totals().handed_back > 0
        assert 0 not in source.committed  # nothing was finished, nothing committed
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
