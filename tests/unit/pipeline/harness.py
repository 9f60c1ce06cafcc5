"""The real pipeline, in-process, behind the fake record source and result sink of
tests/fakes.py, and what its tests share: requests to fetch, the wiring, a revocation
while records are in flight, a run until a condition holds.

The model is ``GatedEcho``, whose forward can be held (a gate) or fail on a poison
value, so the tests see ordering, draining, revocation, expiry, bisection and
backpressure without Kafka, Redis or timing luck.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from producers.testing import until
from schemas import ContentType, encode_request
from tests.fakes import POISON, TOPIC, FakeRecord, FakeSink, FakeSource, GatedEcho, Key
from workers.batching.batcher import CloseReason
from workers.config.worker import WorkerSettings
from workers.intake.admission import Admission, RequestState
from workers.intake.payload_stores import PayloadStore
from workers.intake.references import Claims
from workers.model.runner import ModelRunner
from workers.observe.metrics import Metrics
from workers.pipeline import Pipeline
from workers.publish.answers import Answers
from workers.types import TransactionalSink


def records(
    partition: int, count: int, *, first: int = 0, deadline: datetime | None = None
) -> list[FakeRecord]:
    """Requests ``p<partition>-<n>`` of TOPIC; ``p0-13``'s payload is the poison."""
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


async def revoke_in_flight(source: FakeSource, model: GatedEcho, partition: Key) -> int:
    """Revoke ``partition`` once records of it were fetched, while ``model``'s closed gate
    holds them in flight, opening the gate as the revocation begins. Returns the
    partition's fetched position when it was revoked."""
    await until(lambda: source.position.get(partition, 0) > 0, f"{partition} fetched", 5)
    fetched = source.position[partition]
    revoking = asyncio.create_task(source.revoke(partition))
    assert model.gate is not None
    model.gate.set()
    await revoking
    return fetched


async def run_until(pipeline: Pipeline, done: Callable[[], bool], timeout: float = 10) -> None:
    """Run the pipeline until ``done()`` holds, then stop it and wait for the drain."""
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        await until(done, "the scenario's end", timeout)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)
