"""When the model stage checks a batch for cancellations: as the batch starts, not as it
joins the stage's queue (serial path and three-thread pipeline, both on the CPU here).

The admission is the real ``workers.intake.admission.Admission`` over a fake request
state (a set of cancelled ids and attempt counts, as the Redis script keeps them);
the real one against Redis is tested in tests/faults/test_cancel_status.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from schemas import ContentType, ErrorCode
from schemas.fastpath import FastMeta
from workers.intake.admission import CANCELLED, Admission
from workers.model import inference as inference_module
from workers.model.inference import Inference
from workers.model.runner import ModelRunner
from workers.observe.metrics import Metrics
from workers.offsets import OffsetTracker
from workers.types import Admitted, Item, Outcome

_SPAN = OffsetTracker[tuple[str, int]]().open(("t", 0), 0, 10_000, 10_001)


class HeldModel:
    """Echoes each item's value. Its ``collate`` (a decode on the device, for a real
    model) records when each batch's work began, and holds the first batch until
    ``release`` is set, so that the next batch waits in the stage meanwhile: in the
    model thread's queue on the serial path, in the prepare thread's when pipelined."""

    name = "held"
    version = "held-v1"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.work_ms: list[float] = []
        self.seen: list[int] = []

    def example_item(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.tensor([payload[0]], dtype=torch.uint8)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> None:
        self.work_ms.append(time.time() * 1000.0)
        self.entered.set()
        if len(self.work_ms) == 1:
            assert self.release.wait(10), "the test never released the first batch"
        return None  # stacked as usual

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.seen += [int(row[0]) for row in batch]
        return batch

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [int(row[0]) for row in outputs]


@dataclass
class FakeState:
    """Cancellations and attempts as the Redis script keeps them; each call's time."""

    cancelled: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[float, list[str]]] = field(default_factory=list)
    delay_s: float = 0.0

    async def start(self, ids: Sequence[str]) -> list[int]:
        self.calls.append((time.time() * 1000.0, list(ids)))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for request_id in ids:
            if request_id in self.cancelled:
                out.append(CANCELLED)
            else:
                self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
                out.append(self.attempts[request_id])
        return out


def batch(first: int, size: int, *, deadline_in: float | None = None) -> list[Item]:
    now = time.monotonic()
    out = []
    for value in range(first, first + size):
        meta = FastMeta(f"r{value}", ContentType.TEXT, {}, None, None, None, None, None)
        deadline = None if deadline_in is None else now + deadline_in
        tensor = torch.tensor([value], dtype=torch.uint8)
        out.append(Item(None, _SPAN, meta, 0.0, deadline, tensor))  # type: ignore[arg-type]
    return out


def stage(model: HeldModel, admission: Any, pipelined: bool) -> tuple[Inference, list[Outcome]]:
    done: list[Outcome] = []
    runner = ModelRunner(model, device="cpu")
    return Inference(runner, done.append, pipelined=pipelined, admission=admission), done


def cancelled_ids(outcomes: list[Outcome]) -> set[str]:
    return {
        r.request_id or ""
        for outcome in outcomes
        for r in outcome.refused
        if r.code is ErrorCode.cancelled
    }


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_batch_waiting_in_the_stage_is_checked_when_it_starts(pipelined: bool) -> None:
    """A cancel recorded while its batch waits behind a running one is honoured: the
    second batch is checked when it starts, not when it was submitted, each check comes
    before its batch's work, and the batch's start is the moment of its check."""
    model = HeldModel()
    state = FakeState()
    metrics = Metrics("t")
    inference, done = stage(model, Admission(state, metrics), pipelined)
    try:
        first, second = batch(1, 3), batch(11, 3)
        for items in (first, second):
            await inference.wait_for_slot()
            inference.submit(items)
        assert await asyncio.to_thread(model.entered.wait, 10)
        await asyncio.sleep(0.05)  # the second batch sits in the stage, not yet started
        assert [ids for _, ids in state.calls] == [["r1", "r2", "r3"]]
        state.cancelled.add("r12")  # as a client's cancel, while its batch waits
        model.release.set()
        await inference.wait_idle()
    finally:
        inference.close()
    assert cancelled_ids(done) == {"r12"}
    assert sorted(model.seen) == [1, 2, 3, 11, 13]
    assert [ids for _, ids in state.calls][1] == ["r11", "r12", "r13"]
    starts = sorted(o.timing.start_ms for o in done if o.timing is not None)
    checks = [at for at, _ in state.calls]
    assert len(starts) == 2
    for start, checked, work in zip(starts, checks, model.work_ms, strict=True):
        assert start <= checked <= work  # the batch starts as its check is sent
    assert b'conveyor_cancelled_total{model="t"} 1.0' in metrics.render()


@pytest.mark.parametrize("pipelined", [False, True])
async def test_expired_items_are_neither_checked_nor_run(pipelined: bool) -> None:
    model = HeldModel()
    model.release.set()
    state = FakeState()
    inference, done = stage(model, Admission(state, Metrics("t")), pipelined)
    try:
        await inference.wait_for_slot()
        inference.submit(batch(1, 2, deadline_in=-1.0) + batch(5, 1))
        await inference.wait_idle()
    finally:
        inference.close()
    assert [ids for _, ids in state.calls] == [["r5"]]  # never marked running
    refused = sorted((r.request_id or "", r.code) for o in done for r in o.refused)
    assert refused == [("r1", ErrorCode.expired), ("r2", ErrorCode.expired)]
    assert model.seen == [5]


@pytest.mark.parametrize("pipelined", [False, True])
async def test_attempts_come_from_the_check_and_an_all_cancelled_batch_never_runs(
    pipelined: bool,
) -> None:
    model = HeldModel()
    model.release.set()
    state = FakeState(cancelled={"r1", "r2"}, attempts={"r5": 2})
    inference, done = stage(model, Admission(state, Metrics("t")), pipelined)
    try:
        for items in (batch(1, 2), batch(5, 1)):
            await inference.wait_for_slot()
            inference.submit(items)
        await inference.wait_idle()
    finally:
        inference.close()
    assert cancelled_ids(done) == {"r1", "r2"}
    assert all(r.batch is None for o in done for r in o.refused)  # never in a batch
    assert [(i.meta.id, i.attempt) for o in done for i in o.answered] == [("r5", 3)]
    assert model.seen == [5]


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_check_that_redis_does_not_answer_in_time_lets_the_batch_run(
    pipelined: bool,
) -> None:
    model = HeldModel()
    model.release.set()
    state = FakeState(cancelled={"r1"}, delay_s=5.0)  # far past the admission's bound
    metrics = Metrics("t")
    inference, done = stage(model, Admission(state, metrics, timeout_s=0.05), pipelined)
    started = time.monotonic()
    try:
        await inference.wait_for_slot()
        inference.submit(batch(1, 2))
        await inference.wait_idle()
    finally:
        inference.close()
    assert time.monotonic() - started < 4  # bounded by the admission, not by Redis
    assert cancelled_ids(done) == set()  # fail open: the cancel was not seen
    assert sorted(model.seen) == [1, 2]
    assert b'conveyor_admission_failures_total{model="t"} 1.0' in metrics.render()


@dataclass
class StuckAdmission:
    """An admission that the loop never finishes: its own bound is not kept."""

    timeout_s: float = 0.05
    skips: list[tuple[int, str]] = field(default_factory=list)

    async def admit(self, items: list[Item]) -> Admitted:
        await asyncio.sleep(30)
        raise AssertionError("the stage should have stopped waiting")

    def skipped(self, size: int, why: str) -> None:
        self.skips.append((size, why))


@pytest.mark.parametrize("pipelined", [False, True])
async def test_the_stage_waits_for_the_loop_only_so_long(
    pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inference_module, "_LOOP_SLACK_S", 0.05)
    model = HeldModel()
    model.release.set()
    admission = StuckAdmission()
    inference, _ = stage(model, admission, pipelined)
    try:
        await inference.wait_for_slot()
        inference.submit(batch(1, 2))
        await asyncio.wait_for(inference.wait_idle(), 5)
    finally:
        inference.close()
    assert sorted(model.seen) == [1, 2]
    assert [size for size, _ in admission.skips] == [2]


@dataclass
class BrokenAdmission:
    timeout_s: float = 1.0

    async def admit(self, items: list[Item]) -> Admitted:
        raise ValueError("a bug in the check")

    def skipped(self, size: int, why: str) -> None:
        raise AssertionError("a bug is not an outage")


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_bug_in_the_check_answers_its_batch_internal(pipelined: bool) -> None:
    model = HeldModel()
    model.release.set()
    inference, done = stage(model, BrokenAdmission(), pipelined)
    try:
        await inference.wait_for_slot()
        inference.submit(batch(1, 2))
        await asyncio.wait_for(inference.wait_idle(), 5)
    finally:
        inference.close()
    assert [r.code for o in done for r in o.refused] == [ErrorCode.internal] * 2
    assert model.seen == []
