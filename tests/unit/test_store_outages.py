"""A payload store that is down, as the worker's readiness and metrics see it.

While a store's calls fail, ``Claims.failing_for`` grows (the worker's ``/readyz``
fails once it passes ``--unready-after-s``) and ``conveyor_dataref_store_down`` is 1
for that store only; the first call that succeeds ends the outage. Against the real
SeaweedFS, stopped mid-run: tests/faults/test_references.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas import DataRef
from tests.fakes import DATA_PREFIX as PREFIX
from tests.fakes import FakeStore, Prepared, claims_over, request_item
from workers.intake.payload_stores import Fault, StoreOutage
from workers.observe.metrics import Metrics


@dataclass
class SwitchedStore:
    """Objects by key; every call fails while ``down`` is set."""

    objects: dict[str, bytes]
    down: bool = True
    failures: int = 0
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        self._maybe_fail()
        return [len(self.objects[r.key]) if r.key in self.objects else None for r in refs]

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        self._maybe_fail()
        return [self.objects.get(r.key) for r in refs]

    def _maybe_fail(self) -> None:
        if self.down:
            self.failures += 1
            self.failed.set()
            raise StoreOutage("connection refused")


def down(metrics: Metrics, store: str) -> float | None:
    return metrics.registry.get_sample_value(
        "conveyor_dataref_store_down", {"model": "t", "store": store}
    )


async def test_a_store_is_down_while_its_calls_fail_and_up_after_the_first_success() -> None:
    s3 = SwitchedStore({"a.png": b"payload"})
    metrics = Metrics("t")
    resolver = claims_over({"s3": s3, "redis": FakeStore()}, metrics=metrics)
    assert resolver.failing_for() == 0.0
    assert (down(metrics, "s3"), down(metrics, "redis")) == (0.0, 0.0)  # series from the start
    work = asyncio.ensure_future(
        resolver.resolve([request_item("a", "s3://payloads/a.png")], Prepared())
    )
    await asyncio.wait_for(s3.failed.wait(), 5)
    await asyncio.sleep(0.05)  # the outage lasts a while: retried meanwhile
    assert not work.done()
    assert s3.failures > 1
    assert resolver.failing_for() >= 0.05
    assert (down(metrics, "s3"), down(metrics, "redis")) == (1.0, 0.0)
    s3.down = False
    ready, refused = await asyncio.wait_for(work, 5)
    assert [i.meta.id for i in ready] == ["a"]
    assert refused == []
    assert resolver.failing_for() == 0.0
    assert down(metrics, "s3") == 0.0


async def test_a_store_that_answers_is_never_down() -> None:
    metrics = Metrics("t")
    store = FakeStore({PREFIX + "a": b"payload"})
    resolver = claims_over({"redis": store}, metrics=metrics)
    ready, _ = await resolver.resolve([request_item("a", f"redis:{PREFIX}a")], Prepared())
    assert len(ready) == 1
    assert resolver.failing_for() == 0.0
    assert down(metrics, "redis") == 0.0
