"""Fakes for the unit tests of pure logic: records, the pipeline's ports, handlers, clocks.

The pipeline's ports (``workers.types``: the record source, the result sink, the
transactional sink), the payload store and request state of the intake, model
handlers, and the odd piece of the platform (a clock, a socket transport, the CUDA
runtime), each in memory and each able to show what was done to it. Integration
tests never use these: they talk to the real Kafka, Redis and S3. A variant that
one test alone needs (a store that fails, a sink that counts) is made inside that
test from one of these.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch

from schemas import (
    DEFAULT_LIMITS,
    ContentType,
    DataRef,
    Limits,
    Status,
    decode_request,
    decode_result,
    encode_request,
)
from workers.handlers.base import ImageClassifier
from workers.intake.admission import CANCELLED
from workers.intake.ingest import _from_meta
from workers.intake.payload_stores import Fault, PayloadStore, StoreOutage
from workers.intake.references import ByteBudget, Claims
from workers.model.loader import IMAGENET_IMAGE, IMAGENET_MEAN, IMAGENET_STD
from workers.observe.metrics import Metrics
from workers.offsets import OffsetTracker
from workers.types import (
    Committed,
    Item,
    Outbox,
    PartitionCommit,
    PublishReport,
    Refusal,
    Revoked,
    TopicPartition,
)

TOPIC = "conveyor.t.requests"
"""The requests topic of the fake source's numbered partitions."""
POISON = 255
"""A payload whose first byte is this makes ``GatedEcho.forward`` raise."""

# -- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeRecord:
    """A fetched record (``workers.types.Record``), as aiokafka's ``ConsumerRecord`` has it."""

    topic: str
    partition: int
    offset: int
    timestamp: int = 0
    key: bytes | None = None
    value: bytes | None = None
    headers: Sequence[tuple[str, bytes | None]] = ()
    checksum: int | None = None


Key = int | TopicPartition  # a partition of TOPIC, or (topic, partition)


def topic_partition(key: Key) -> TopicPartition:
    return (TOPIC, key) if isinstance(key, int) else key


# -- the pipeline's ports ----------------------------------------------------------------------


@dataclass
class FakeSource:
    """Partitions of records; fetch hands them out in order, a few at a time.

    Partitions are keyed by number (partitions of TOPIC) or by (topic, partition);
    ``position`` and ``committed`` use the same keys. While a revocation's handler
    runs, fetch hands out nothing, as the Kafka consumer does during a rebalance.
    """

    partitions: dict[Key, list[FakeRecord]]
    position: dict[Key, int] = field(default_factory=dict)
    committed: dict[Key, int] = field(default_factory=dict)
    paused_seen: list[bool] = field(default_factory=list)
    paused: frozenset[str] = frozenset()
    revoke_handler: Revoked | None = None
    rebalancing: bool = False
    restarted: list[TopicPartition] = field(default_factory=list)
    # Whether caught_up reports it (every partition handed out to its end, none paused);
    # off: never caught up, so batches wait for the timer as they did before the rule.
    reports_caught_up: bool = False

    async def fetch(
        self, timeout_ms: int, max_records: int
    ) -> Mapping[TopicPartition, Sequence[FakeRecord]]:
        await asyncio.sleep(0)
        out: dict[TopicPartition, list[FakeRecord]] = {}
        for key, records in self.partitions.items():
            if self.rebalancing or topic_partition(key)[0] in self.paused:
                continue
            start = self.position.get(key, 0)
            chunk = records[start : start + max(1, max_records // 4)]
            if chunk:
                out[topic_partition(key)] = chunk
                self.position[key] = start + len(chunk)
        if not out:
            await asyncio.sleep(timeout_ms / 1000)
        return out

    def set_paused(self, topics: AbstractSet[str]) -> None:
        self.paused = frozenset(topics)
        self.paused_seen.append(bool(topics))

    async def commit(self, positions: Mapping[TopicPartition, int]) -> bool:
        for key in self.partitions:
            if topic_partition(key) in positions:
                self.committed[key] = positions[topic_partition(key)]
        return True

    def on_revoke(self, handler: Revoked) -> None:
        self.revoke_handler = handler

    async def restart(self, partitions: Collection[TopicPartition]) -> None:
        """Fetch again from the committed positions."""
        for key in list(self.partitions):
            if topic_partition(key) in partitions:
                self.restarted.append(topic_partition(key))
                self.position[key] = self.committed.get(key, 0)

    def lag(self) -> Mapping[TopicPartition, int]:
        return {}

    def caught_up(self) -> bool:
        if not self.reports_caught_up or self.paused or self.rebalancing:
            return False
        return all(self.position.get(key, 0) >= len(rs) for key, rs in self.partitions.items())

    async def revoke(self, partition: Key) -> None:
        """As a rebalance does: the pipeline drains, then the partition is gone."""
        assert self.revoke_handler is not None
        self.rebalancing = True
        try:
            await self.revoke_handler({topic_partition(partition)})
        finally:
            self.rebalancing = False
        del self.partitions[partition]


@dataclass
class RevokedOnFetch(FakeSource):
    """Revokes partition ``key`` as soon as a fetch hands out its records, before the
    pipeline has taken them (as a rebalance may, right after ``getmany`` returned)."""

    key: Key = 1
    revoking: asyncio.Task[None] | None = None

    async def fetch(
        self, timeout_ms: int, max_records: int
    ) -> Mapping[TopicPartition, Sequence[FakeRecord]]:
        out = await super().fetch(timeout_ms, max_records)
        if self.revoking is None and topic_partition(self.key) in out:
            self.revoking = asyncio.create_task(self.revoke(self.key))
        return out


@dataclass
class FakeSink:
    """Keeps the first value published for each request id, as the result store does."""

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


@dataclass
class HeldSink(FakeSink):
    """Holds every publish until ``release`` is set; counts the calls in progress."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    fail_with: Exception | None = None
    in_progress: int = 0
    most: int = 0

    async def publish(self, outbox: Outbox) -> PublishReport:
        self.in_progress += 1
        self.most = max(self.most, self.in_progress)
        try:
            await self.release.wait()
            if self.fail_with is not None:
                raise self.fail_with
            return await super().publish(outbox)
        finally:
            self.in_progress -= 1


@dataclass
class FakeTransactions:
    """Commits what it is given (as the broker would, offsets into ``source.committed``);
    loses the next transaction of partitions in ``lose``."""

    source: FakeSource
    committed: list[PartitionCommit] = field(default_factory=list)
    lose: set[TopicPartition] = field(default_factory=set)
    closed: list[TopicPartition] = field(default_factory=list)

    async def publish(self, parts: Sequence[PartitionCommit]) -> tuple[list[Committed], int]:
        await asyncio.sleep(0)
        ended = []
        for part in parts:
            if part.partition in self.lose:
                self.lose.discard(part.partition)
                ended.append(Committed.LOST)
                continue
            self.committed.append(part)
            self.source.committed[part.partition[1]] = part.position
            ended.append(Committed.YES)
        return ended, 0

    async def close(self, partitions: Collection[TopicPartition]) -> None:
        self.closed.extend(partitions)

    async def aclose(self) -> None:
        pass

    def ids(self) -> list[str]:
        return [i for part in self.committed for i in part.outbox.ids]


# -- the intake: payload stores, request state, preprocess -------------------------------------


@dataclass
class FakeStore:
    """A payload store (``PayloadStore``): objects by key; the first ``outages`` calls
    fail; records the keys each read asked for, and the most ``budget`` held meanwhile."""

    objects: dict[str, bytes] = field(default_factory=dict)
    outages: int = 0
    reads: list[list[str]] = field(default_factory=list)
    budget: ByteBudget | None = None
    peak_held: int = 0

    async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
        self._maybe_fail()
        return [len(self.objects[r.key]) if r.key in self.objects else None for r in refs]

    async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
        self._maybe_fail()
        self.reads.append([r.key for r in refs])
        if self.budget is not None:
            self.peak_held = max(self.peak_held, self.budget.used)
        await asyncio.sleep(0)
        return [self.objects.get(r.key) for r in refs]

    def _maybe_fail(self) -> None:
        if self.outages:
            self.outages -= 1
            raise StoreOutage("connection refused")


@dataclass
class FakeState:
    """Cancellations and attempt counts (``RequestState``), as the Redis script keeps them."""

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


class Prepared:
    """The pipeline's preprocess, recorded: which items with which payloads."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, bytes]]] = []

    async def __call__(
        self, items: list[Item], payloads: list[bytes]
    ) -> tuple[list[Item], list[Refusal]]:
        self.calls.append([(i.meta.id, p) for i, p in zip(items, payloads, strict=True)])
        return items, []


# -- handlers ----------------------------------------------------------------------------------


class GatedEcho:
    """Each payload's first byte, echoed; a first byte of POISON makes forward raise.

    ``gate`` (when set) holds every forward after the first ``hold_after`` calls until
    it is opened; ``calls`` counts the forwards begun, ``seen`` the items forward ran on.
    """

    name = "echo"
    version = "echo-v1"

    def __init__(self, hold_after: int = 0) -> None:
        self.gate: threading.Event | None = None
        self.hold_after = hold_after
        self.calls = 0
        self.seen = 0

    def example_item(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.tensor([payload[0]], dtype=torch.uint8)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.gate is not None and self.calls > self.hold_after:
            assert self.gate.wait(10), "the test never opened the gate"
        if bool((batch == POISON).any()):
            raise RuntimeError("poison in this batch")
        self.seen += len(batch)
        return batch

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [int(row[0]) for row in outputs]


class Echo:
    """A handler whose result for an item is its input times ten and its params;
    ``batch_sizes`` lists the size of every batch forward saw."""

    name = "echo"
    version = "echo-v1"

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def example_item(self) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.int64)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.tensor(list(payload), dtype=torch.int64)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(len(batch))
        return batch * 10

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [
            {"out": row, "params": dict(p)} for row, p in zip(outputs.tolist(), params, strict=True)
        ]


class TinyClassifier(ImageClassifier):
    """A 10-class conv net on ImageNet-sized input that costs milliseconds on a CPU, served
    through the loader's ``module:Class`` spec (``tests.fakes:TinyClassifier``)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        limits: Limits = DEFAULT_LIMITS,
        decode: Any = "auto",
    ) -> None:
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(4, 10),
        )  # fmt: skip
        super().__init__(
            module,
            name="tiny",
            version="tiny:random-weights",
            labels=[str(i) for i in range(10)],
            image=IMAGENET_IMAGE,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            decode=decode,
        )


# -- the platform ------------------------------------------------------------------------------


@dataclass
class FakeClock:
    """A monotonic clock that moves only when a test moves ``now`` or the code under test
    waits (``wait``, each wait recorded in ``waits``)."""

    now: float
    waits: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(round(seconds, 6))
        self.now += seconds


class FakeTransport(asyncio.Transport):
    """Records pause_reading / resume_reading, as a socket transport would obey them."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.pauses = 0

    def pause_reading(self) -> None:
        assert not self.paused
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        assert self.paused
        self.paused = False


class FakeRuntime:
    """The CUDA runtime's cudaSetDeviceFlags / cudaGetDeviceFlags over one stored value."""

    def __init__(self, reports: int | None = None) -> None:
        self.flags = 0
        self.reports = reports  # what cudaGetDeviceFlags says, if not the stored value

    def cudaSetDeviceFlags(self, flags: ctypes.c_uint) -> int:
        self.flags = flags.value
        return 0

    def cudaGetDeviceFlags(self, out: Any) -> int:
        out._obj.value = self.flags if self.reports is None else self.reports
        return 0


# -- payloads by reference --------------------------------------------------------------


DATA_PREFIX = "conveyor:data:"
"""The Redis prefix payloads by reference may live under, in the claim tests."""


def request_item(
    request_id: str, dataref: str | None = None, expires: datetime | None = None
) -> Item:
    """A parsed request, its payload inline or named by ``dataref``, as ingest makes it."""
    record = encode_request(
        b"" if dataref else b"inline",
        request_id=request_id,
        content_type=ContentType.TEXT,
        source="t",
        dataref=dataref,
        dataexpires=expires,
    )
    meta = decode_request(record.headers, record.key, record.value, 0).meta
    span = OffsetTracker[str]().open("p", 0, 0, 1)
    fake = FakeRecord("t", 0, 0, key=record.key, value=record.value, headers=record.headers)
    return Item(fake, span, _from_meta(meta), 0.0, None)


def claims_over(stores: dict[str, PayloadStore], **options: object) -> Claims:
    """Claims over ``stores`` with small, test-sized limits (``options`` override them)."""
    settings: dict[str, object] = {
        "redis_prefix": DATA_PREFIX,
        "s3_buckets": frozenset({"payloads"}),
        "max_bytes": 1000,
        "budget_bytes": 100,
        "metrics": Metrics("t"),
        "backoff_start_s": 0.001,
        **options,
    }
    return Claims(stores, **settings)  # type: ignore[arg-type]
