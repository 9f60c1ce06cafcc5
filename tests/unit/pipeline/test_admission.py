"""Admission through the pipeline: cancelled requests answered without reaching the
model, the attempt the request state counted, and a state store that fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas import ErrorCode, Status, decode_result
from tests.fakes import FakeSource, FakeState, GatedEcho
from tests.unit.pipeline.harness import make, records, run_until
from workers.observe.metrics import Metrics


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
