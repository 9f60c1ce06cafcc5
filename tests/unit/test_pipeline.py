"""The real pipeline, in-process, behind a fake record source and a fake result sink.

The model is a tiny handler whose forward can be held (a gate) or fail on a poison
value, so the tests see ordering, draining, revocation, expiry, bisection and
backpressure without Kafka, Redis or timing luck.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
import torch

from schemas import ContentType, DataRef, ErrorCode, Status, decode_result, encode_request
from workers.admission import CANCELLED, Admission, RequestState
from workers.answers import Answers
from workers.claims import Claims, Fault, PayloadStore
from workers.metrics import Metrics
from workers.pipeline import Pipeline
from workers.runner import ModelRunner
from workers.settings import WorkerSettings
from workers.types import Outbox, PublishReport, Revoked, TopicPartition

TOPIC = "conveyor.t.requests"
POISON = 255


class EchoModel:
    """Each payload's first byte, echoed; a first byte of 255 makes forward raise.

    ``gate`` (when set) holds every forward after the first ``hold_after`` calls until
    it is opened; ``entered`` counts calls, ``seen`` the items forward ran on.
    """

    name = "echo"
    version = "echo-v1"

    def __init__(self, hold_after: int = 0) -> None:
        self.gate: threading.Event | None = None
        self.hold_after = hold_after
        self.calls = 0
        self.entered = threading.Semaphore(0)
        self.seen = 0

    def example_item(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.tensor([payload[0]], dtype=torch.uint8)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.entered.release()
        if self.gate is not None and self.calls > self.hold_after:
            assert self.gate.wait(10), "the test never opened the gate"
        if bool((batch == POISON).any()):
            raise RuntimeError("poison in this batch")
        self.seen += len(batch)
        return batch

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [int(row[0]) for row in outputs]


@dataclass(frozen=True)
class FakeRecord:
    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]
    checksum: int | None = None


@dataclass
class FakeSource:
    """Partitions of records; fetch hands them out in order, a few at a time."""

    partitions: dict[int, list[FakeRecord]]
    position: dict[int, int] = field(default_factory=dict)
    committed: dict[int, int] = field(default_factory=dict)
    paused_seen: list[bool] = field(default_factory=list)
    paused: bool = False
    revoke_handler: Revoked | None = None

    async def fetch(
        self, timeout_ms: int, max_records: int
    ) -> Mapping[TopicPartition, Sequence[FakeRecord]]:
        await asyncio.sleep(0)
        if self.paused:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        out: dict[TopicPartition, list[FakeRecord]] = {}
        for p, records in self.partitions.items():
            start = self.position.get(p, 0)
            chunk = records[start : start + max(1, max_records // 4)]
            if chunk:
                out[(TOPIC, p)] = chunk
                self.position[p] = start + len(chunk)
        if not out:
            await asyncio.sleep(timeout_ms / 1000)
        return out

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.paused_seen.append(paused)

    async def commit(self, positions: Mapping[TopicPartition, int]) -> bool:
        for (_, p), position in positions.items():
            if p in self.partitions:
                self.committed[p] = position
        return True

    def on_revoke(self, handler: Revoked) -> None:
        self.revoke_handler = handler

    def lag(self) -> Mapping[TopicPartition, int]:
        return {}

    async def revoke(self, partition: int) -> None:
        """As a rebalance does: the pipeline drains, then the partition is gone."""
        assert self.revoke_handler is not None
        await self.revoke_handler({(TOPIC, partition)})
        del self.partitions[partition]


@dataclass
class FakeSink:
    outboxes: list[Outbox] = field(default_factory=list)
    stored: dict[str, bytes] = field(default_factory=dict)

    async def publish(self, outbox: Outbox) -> PublishReport:
        await asyncio.sleep(0)
        duplicates = 0
        for request_id, value in zip(outbox.ids, outbox.values, strict=True):
            if request_id in self.stored:
                duplicates += 1
            else:
                self.stored[request_id] = value
        self.outboxes.append(outbox)
        return PublishReport(duplicates)

    def published_ids(self) -> list[str]:
        return [i for box in self.outboxes for i in box.ids]

    def status(self, request_id: str) -> Status:
        return decode_result(self.stored[request_id]).status


def records(
    partition: int, count: int, *, first: int = 0, deadline: datetime | None = None
) -> list[FakeRecord]:
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
    model: EchoModel,
    *,
    stores: Mapping[str, PayloadStore] | None = None,
    state: RequestState | None = None,
    metrics: Metrics | None = None,
    **settings: Any,
) -> tuple[Pipeline, FakeSink]:
    options = {"max_batch_size": 8, "max_delay_ms": 1.0, "decode_threads": 1, **settings}
    s = WorkerSettings(model="tests:Echo", model_name="t", device="cpu", **options)
    sink = FakeSink()
    runner = ModelRunner(model, device="cpu")
    answers = Answers("t", model.version, "w1", max_result_bytes=1 << 20)
    metrics = metrics or Metrics("t")
    claims = None if stores is None else Claims.from_settings(s, metrics, stores)
    admission = None if state is None else Admission(state, metrics)
    pipeline = Pipeline(
        s, source, sink, runner, answers, metrics, claims=claims, admission=admission
    )
    return pipeline, sink


async def run_until(pipeline: Pipeline, done: Any, timeout: float = 10) -> None:
    """Run the pipeline until ``done()`` holds, then stop it and wait for the drain."""
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)


async def test_every_record_is_answered_once_in_partition_order() -> None:
    source = FakeSource({0: records(0, 40), 1: records(1, 40)})
    model = EchoModel()
    pipeline, sink = make(source, model)
    await run_until(pipeline, lambda: len(sink.stored) == 80)
    ids = sink.published_ids()
    assert sorted(ids) == sorted(f"p{p}-{n}" for p in (0, 1) for n in range(40))
    assert len(ids) == 80  # once each
    for p in (0, 1):
        ok = [i for i in ids if i.startswith(f"p{p}-") and i != "p0-13"]
        assert ok == sorted(ok, key=lambda i: int(i.split("-")[1]))
    assert source.committed == {0: 40, 1: 40}
    # Bisection: the poison item failed alone, everything else is ok.
    assert sink.status("p0-13") is Status.error
    assert decode_result(sink.stored["p0-13"]).error.code == ErrorCode.model_error  # type: ignore[union-attr]
    assert sum(sink.status(i) is Status.ok for i in sink.stored) == 79
    assert pipeline.stats.answered == 80


async def test_results_carry_their_reply_topic_partition_and_timings() -> None:
    source = FakeSource({2: records(2, 3)})
    pipeline, sink = make(source, EchoModel())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    box = sink.outboxes[0]
    assert box.partitions[0] == 2
    assert box.reply_to[0] is None
    doc = orjson.loads(box.values[0])
    timings = doc["timings"]
    assert timings["batch_size"] >= 1
    assert timings["received_ms"] <= timings["batch_start_ms"] <= timings["finished_ms"]
    assert timings["finished_ms"] <= timings["published_ms"]
    assert dict(box.headers[0])["ce_subject"] == box.ids[0].encode()


async def test_stop_drains_what_was_fetched() -> None:
    source = FakeSource({0: records(0, 30)})
    model = EchoModel()
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    await asyncio.to_thread(model.entered.acquire, True, 5)  # a batch is in the model
    stop.set()
    model.gate.set()
    await asyncio.wait_for(task, 10)
    fetched = source.position[0]
    assert len(sink.stored) == fetched
    assert source.committed[0] == fetched


async def test_a_finished_batch_is_published_while_the_next_one_runs() -> None:
    source = FakeSource({0: records(0, 16)})
    model = EchoModel(hold_after=1)
    model.gate = threading.Event()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        for _ in range(2):  # the first batch ran, the second is held in the model
            assert await asyncio.to_thread(model.entered.acquire, True, 5)
        async with asyncio.timeout(5):
            while len(sink.stored) < model.seen:
                await asyncio.sleep(0.01)
        assert 0 < len(sink.stored) < 16
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == 16


async def test_expired_requests_never_reach_the_model() -> None:
    past = datetime.now(UTC) - timedelta(seconds=5)
    source = FakeSource({0: records(0, 5, deadline=past) + records(0, 5, first=5)})
    model = EchoModel()
    pipeline, sink = make(source, model)
    await run_until(pipeline, lambda: len(sink.stored) == 10)
    assert [sink.status(f"p0-{n}") for n in range(10)] == [Status.expired] * 5 + [Status.ok] * 5
    assert model.seen == 5
    assert not any(box.dead for box in sink.outboxes)  # expiry is not a dead letter


async def test_backpressure_pauses_fetching_at_the_in_flight_cap() -> None:
    source = FakeSource({0: records(0, 200)})
    model = EchoModel()
    model.gate = threading.Event()
    pipeline, sink = make(source, model, max_in_flight=16)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while True not in source.paused_seen:
                await asyncio.sleep(0.01)
        assert source.position[0] <= 16 + 8  # at most one fetch past the cap
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(sink.stored) == source.position[0]


async def test_revoke_drains_commits_and_forgets_the_partition() -> None:
    source = FakeSource({0: records(0, 24), 1: records(1, 24)})
    model = EchoModel()
    pipeline, sink = make(source, model)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        async with asyncio.timeout(5):
            while source.position.get(1, 0) == 0:
                await asyncio.sleep(0.001)
        fetched = source.position[1]
        await source.revoke(1)
        # Everything fetched from partition 1 was answered before it went away.
        assert all(f"p1-{n}" in sink.stored for n in range(fetched))
        assert source.committed[1] == fetched
        assert pipeline.stats.handed_back == 0
        async with asyncio.timeout(5):
            while len([i for i in sink.stored if i.startswith("p0-")]) < 24:
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_drain_past_its_bound_hands_the_rest_back_uncommitted() -> None:
    source = FakeSource({0: records(0, 20)})
    model = EchoModel()
    model.gate = threading.Event()
    pipeline, _sink = make(source, model, max_drain_ms=200, rebalance_timeout_ms=5_200)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        assert await asyncio.to_thread(model.entered.acquire, True, 5)
        await source.revoke(0)  # the model is stuck: the drain gives up after 200 ms
        assert pipeline.stats.handed_back > 0
        assert 0 not in source.committed  # nothing was finished, nothing committed
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize(
    ("headers_change", "code"),
    [
        (lambda h: [x for x in h if x[0] != "ce_source"], ErrorCode.bad_request),
        (lambda h: [*h, ("ce_params", b"[1]")], ErrorCode.bad_request),
        (
            lambda h: [(n, b"image/gif" if n == "content-type" else v) for n, v in h],
            ErrorCode.unsupported_media_type,
        ),
    ],
)
async def test_bad_records_get_error_results_and_dead_letters(
    headers_change: Any, code: ErrorCode
) -> None:
    good = records(0, 3)
    bad = good[1]
    good[1] = FakeRecord(
        bad.topic, 0, bad.offset, 0, bad.key, bad.value, headers_change(list(bad.headers))
    )
    source = FakeSource({0: good})
    pipeline, sink = make(source, EchoModel())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    result = decode_result(sink.stored["p0-1"])
    assert result.error is not None
    assert result.error.code == code
    dead = [letter for box in sink.outboxes for letter in box.dead]
    assert len(dead) == 1
    assert dead[0].value == bad.value
    assert source.committed == {0: 3}


async def test_error_results_go_to_ce_replyto_with_a_checked_traceparent() -> None:
    good = records(0, 3)
    trace = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for n, traceparent in ((0, trace), (1, b"not-a-trace-context")):
        r = good[n]
        headers = [h for h in r.headers if h[0] != "ce_source"]  # a bad request
        headers += [("ce_replyto", b"my.replies"), ("traceparent", traceparent)]
        good[n] = FakeRecord(r.topic, 0, r.offset, 0, r.key, r.value, headers)
    source = FakeSource({0: good})
    pipeline, sink = make(source, EchoModel())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    sent = {
        request_id: (reply_to, dict(headers))
        for box in sink.outboxes
        for request_id, reply_to, headers in zip(box.ids, box.reply_to, box.headers, strict=True)
    }
    assert sent["p0-0"][0] == "my.replies"
    assert sent["p0-0"][1]["traceparent"] == trace
    assert sent["p0-1"][0] == "my.replies"
    assert "traceparent" not in sent["p0-1"][1]  # malformed: dropped, as W3C says
    assert sent["p0-2"][0] is None


# -- payloads by reference, cancellation, status --------------------------------------


@dataclass
class MemoryStore:
    """A payload store of the claims port, in memory (the adapters have their own tests)."""

    objects: dict[str, bytes]

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        return [len(self.objects[r.key]) if r.key in self.objects else None for r in refs]

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        return [self.objects.get(r.key) for r in refs]


def referenced(partition: int, first: int, count: int) -> list[FakeRecord]:
    """Requests whose one-byte payloads are stored as conveyor:data:<id>."""
    out = []
    for n in range(first, first + count):
        rid = f"p{partition}-{n}"
        record = encode_request(
            b"",
            request_id=rid,
            content_type=ContentType.TEXT,
            source="t",
            dataref=f"redis:conveyor:data:{rid}",
        )
        out.append(FakeRecord(TOPIC, partition, n, 0, record.key, record.value, record.headers))
    return out


async def test_referenced_payloads_are_served_in_partition_order_among_inline_ones() -> None:
    mixed = records(0, 4) + referenced(0, 4, 4) + records(0, 4, first=8)
    stored = {f"conveyor:data:p0-{n}": bytes([100 + n]) for n in range(4, 8)}
    del stored["conveyor:data:p0-6"]  # one of them was never stored
    source = FakeSource({0: mixed})
    pipeline, sink = make(source, EchoModel(), stores={"redis": MemoryStore(stored)})
    await run_until(pipeline, lambda: len(sink.stored) == 12)
    outputs = {i: decode_result(v).outputs for i, v in sink.stored.items()}
    assert [outputs[f"p0-{n}"] for n in (4, 5, 7)] == [104, 105, 107]  # the stored bytes
    error = decode_result(sink.stored["p0-6"]).error
    assert error is not None
    assert error.code == ErrorCode.dataref_missing
    ok = [i for i in sink.published_ids() if i != "p0-6"]
    assert ok == sorted(ok, key=lambda i: int(i.split("-")[1]))
    assert source.committed == {0: 12}


async def test_a_worker_without_stores_refuses_references() -> None:
    source = FakeSource({0: referenced(0, 0, 2)})
    pipeline, sink = make(source, EchoModel())
    await run_until(pipeline, lambda: len(sink.stored) == 2)
    assert {decode_result(v).error.code for v in sink.stored.values()} == {  # type: ignore[union-attr]
        ErrorCode.dataref_denied
    }


@dataclass
class FakeState:
    """Cancellations and attempt counts, as the Redis script keeps them."""

    cancelled: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # ids per call

    async def start(self, ids: Sequence[str]) -> list[int]:
        self.sizes.append(len(ids))
        out = []
        for request_id in ids:
            if request_id in self.cancelled:
                out.append(CANCELLED)
            else:
                self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
                out.append(self.attempts[request_id])
        return out


async def test_cancelled_requests_are_answered_without_reaching_the_model() -> None:
    source = FakeSource({0: records(0, 40, first=100)})
    model = EchoModel()
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
    pipeline, sink = make(source, EchoModel(), state=state)
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    assert [decode_result(sink.stored[f"p0-{n}"]).attempt for n in (100, 101, 102)] == [1, 3, 1]


async def test_a_state_store_that_fails_lets_the_batch_run() -> None:
    class Down:
        async def start(self, ids: Sequence[str]) -> list[int]:
            raise ConnectionError("Redis is down")

    source = FakeSource({0: records(0, 5, first=100)})
    metrics = Metrics("t")
    pipeline, sink = make(source, EchoModel(), state=Down(), metrics=metrics)
    await run_until(pipeline, lambda: len(sink.stored) == 5)
    assert {decode_result(v).status for v in sink.stored.values()} == {Status.ok}
    assert b"conveyor_admission_failures_total" in metrics.render()
