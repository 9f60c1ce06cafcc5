"""The worker's shared types: what flows between the stages, and the ports they talk through.

A leaf module: the stages (ingest, batcher, inference, publish) and the adapters
(``workers.kafka.consumer`` for Kafka, ``workers.publish.publisher`` for Redis and the reply
topic) import it; it imports none of them.

The flow of one record::

    Record ──ingest──▶ Item ──batcher──▶ inference ──▶ Outcome ──publish──▶ Outbox ──▶ ResultSink
       └──────────────▶ Refusal (bad input, expired, model failure) ──▶ Outcome ─┘

Every record fetched ends in exactly one ``Item`` answered ``ok`` or one
``Refusal``, and its span in ``workers.offsets`` is finished only once that
answer is durable.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from schemas import ErrorCode
from schemas.fastpath import FastMeta
from workers.offsets import Span


class ConfigError(Exception):
    """Only an operator can fix this (a missing topic, a refused ACL): the worker exits
    with status 3 and this message, rather than stall or retry forever."""


class DeviceLost(Exception):
    """The model's device stopped running work: a sticky CUDA error (an illegal memory
    access, a fatal fault of another client of the same MPS server, a GPU fallen off the
    bus) fails every later call of the process. The worker stops without answering the
    batches it holds, their offsets uncommitted, so another member serves them; it
    exits with status 7 for its supervisor to restart it."""


class LoadOnDeviceFailed(Exception):
    """The model did not load or warm up on the process's device, and not by its own
    fault: too little memory, or a device (CUDA) error while it loaded (the same model
    may load on another card, or with more memory free). The worker exits with status 9;
    its supervisor counts a failed start of that card (docs/operations.md)."""


TopicPartition = tuple[str, int]
"""A partition of a topic; aiokafka's ``TopicPartition`` is such a named tuple."""


class Record(Protocol):
    """A fetched Kafka record: what the pipeline reads of aiokafka's ``ConsumerRecord``.

    In production these are aiokafka's ``ConsumerRecord``, also when
    ``workers.kafka.records`` read the batch leniently (aiokafka builds them from its
    records); unit tests pass their own. aiokafka ships no type information, so
    ``tests/unit/test_kafka_records.py`` checks at run time that its records fit.
    A Protocol costs nothing per record: the pipeline reads plain attributes.
    """

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int:
        """When the record was produced (or appended), epoch milliseconds."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]]: ...
    @property
    def checksum(self) -> int | None:
        """``workers.kafka.records.REPAIRED`` for a record read leniently, else None."""


@dataclass(slots=True, eq=False)
class Item:
    """A request on its way to the model."""

    record: Record
    span: Span
    meta: FastMeta
    received_ms: float  # wall clock, epoch ms: comparable with the record timestamp
    deadline_at: float | None  # monotonic seconds
    tensor: Any = None  # what the handler's preprocess made of the payload
    attempt: int = 1  # counted in Redis when status is tracked (workers.intake.admission)


@dataclass(slots=True, eq=False)
class Refusal:
    """A record answered without an output: bad input, expired, or the model failed on it.

    With a usable ``request_id`` it gets an error result; when ``dead_letter`` is set
    its original record is copied to the dead-letter topic as well.
    """

    record: Record
    span: Span
    code: ErrorCode
    message: str
    field: str | None
    request_id: str | None
    received_ms: float
    reply_to: str | None = None
    traceparent: str | None = None
    dead_letter: bool = True
    batch: BatchTiming | None = None  # set when the model ran on it (model failures)
    attempt: int = 1

    @classmethod
    def of(
        cls,
        item: Item,
        code: ErrorCode,
        message: str,
        field: str | None = None,
        *,
        dead_letter: bool = True,
    ) -> Refusal:
        """The refusal of a parsed request: its id, reply topic, trace and attempt kept."""
        meta = item.meta
        return cls(
            item.record,
            item.span,
            code,
            message,
            field,
            meta.id,
            item.received_ms,
            reply_to=meta.reply_to,
            traceparent=meta.traceparent,
            dead_letter=dead_letter,
            attempt=item.attempt,
        )


@dataclass(frozen=True, slots=True)
class BatchTiming:
    """When one batch ran on the model: epoch ms and its size."""

    start_ms: float
    finished_ms: float
    inference_ms: float
    size: int


@dataclass(slots=True, eq=False)
class Outcome:
    """A unit of finished work for the publish stage: answered items and refusals.

    ``outputs[i]`` is the model's answer for ``answered[i]``; ``timing`` says how
    the batch ran (None for refusals that never reached the model).
    """

    answered: list[Item] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    timing: BatchTiming | None = None
    refused: list[Refusal] = field(default_factory=list)
    lost: DeviceLost | None = None
    """Set, and nothing else, when the device failed: the batch must not be answered."""


class Admitted(NamedTuple):
    """A batch after its cancellation and status check (``workers.intake.admission``)."""

    items: list[Item]  # to run, each with its ``attempt``
    cancelled: list[Refusal]  # answered ``cancelled`` without running
    checked_ms: float  # epoch ms when the check was sent: the batch's start


class AdmissionCheck(Protocol):
    """The last look at a batch before the model (``workers.intake.admission.Admission``):
    the model stage asks it, on the event loop, just before the batch starts."""

    timeout_s: float
    """How long ``admit`` takes at most: past it the batch runs as it is (fail open)."""

    async def admit(self, items: list[Item]) -> Admitted:
        """``items`` less the cancelled ones, which come back as refusals."""

    def skipped(self, size: int, why: str) -> None:
        """Note a batch of ``size`` that runs without its check, and why."""


class ModelStage(Protocol):
    """What the pipeline's batch loop drives: ``workers.model.inference.Inference`` (a
    batch in, a batch out) or ``workers.generation.stage.Generating`` (a running engine
    that each request joins alone). Both report each finished unit of work as an
    ``Outcome`` to the callback they were built with."""

    seconds_per_item: float | None
    """Model time per item over recent work (None: nothing measured)."""

    async def wait_for_slot(self) -> None:
        """Wait until the stage can take more work; ``submit`` or ``release_slot`` next."""

    def takes_partial(self) -> bool:
        """Whether a batch that is not full may join the stage now."""

    def release_slot(self) -> None:
        """Give back a slot that no work used."""

    def submit(self, items: list[Item]) -> None:
        """Start ``items`` (a slot taken); their outcomes come to the callback."""

    async def wait_idle(self) -> None:
        """Wait until everything submitted has been reported."""

    def close(self) -> None:
        """Stop the stage's threads (after ``wait_idle``, or to abandon its work)."""


@dataclass(slots=True)
class DeadLetter:
    """A copy of a record that could not be served, with the reason in its headers."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass(slots=True, eq=False)
class Parent:
    """An answer that feeds a next stage (``workers.chain``): its document is not a result
    yet, but the start of the request's join."""

    item: Item
    output: Any  # the model's output, as the document has it
    document: bytes  # this stage's result document
    up: tuple[str, int, int] | None = None
    """When the request is itself a child (a chain of three models or more): its
    parent's id, its index and its parent's child count; its answer, complete, goes to
    that parent's join instead of the results."""


@dataclass(slots=True)
class ChildAnswer:
    """The result document of a child request (``schemas.chain``): it goes to its
    parent's join, not to the result cache under its own id."""

    request_id: str
    parent: str
    index: int
    count: int
    document: bytes
    partition: int  # the child request's partition


@dataclass(slots=True)
class Request:
    """A request record for another model's topic (a pipeline's child)."""

    topic: str
    partition: int
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(slots=True)
class Outbox:
    """One publish call's results, in parallel lists, and its dead letters.

    In a pipeline (``workers.chain``) it also carries, before ``Chain.settle``, the
    answers that feed a next stage (``parents``) and the answers of child requests
    (``children``); after it, the child requests to send (``requests``) and, among
    the results, the parents whose every child is answered.
    """

    ids: list[str] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    headers: list[list[tuple[str, bytes]]] = field(default_factory=list)
    reply_to: list[str | None] = field(default_factory=list)  # None: the results topic
    partitions: list[int] = field(default_factory=list)  # the request's partition
    dead: list[DeadLetter] = field(default_factory=list)
    parents: list[Parent] = field(default_factory=list)
    children: list[ChildAnswer] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def add(
        self,
        request_id: str,
        value: bytes,
        headers: list[tuple[str, bytes]],
        reply_to: str | None,
        partition: int,
    ) -> None:
        self.ids.append(request_id)
        self.values.append(value)
        self.headers.append(headers)
        self.reply_to.append(reply_to)
        self.partitions.append(partition)


@dataclass(frozen=True, slots=True)
class PublishReport:
    duplicates: int  # results already in Redis (redelivered requests): left unchanged


Revoked = Callable[[set[TopicPartition]], Awaitable[None]]
Assigned = Callable[[set[TopicPartition]], Awaitable[None]]


class RecordSource(Protocol):
    """Where requests come from: a consumer-group member (``workers.kafka.consumer.Consumer``)."""

    async def fetch(
        self, timeout_ms: int, max_records: int
    ) -> Mapping[TopicPartition, Sequence[Record]]:
        """The next records per partition, in offset order; empty after ``timeout_ms``."""

    def set_paused(self, topics: Set[str]) -> None:
        """Fetch from every assigned partition except those of ``topics`` (backpressure)."""

    async def commit(self, positions: Mapping[TopicPartition, int]) -> bool:
        """Commit these positions; False when it failed (retried later by the caller)."""

    def on_revoke(self, handler: Revoked) -> None:
        """Call ``handler`` with partitions about to be taken away, and wait for it."""

    async def restart(self, partitions: Collection[TopicPartition]) -> None:
        """Fetch ``partitions`` again from their committed positions, as after a new
        assignment (the assignment handler runs for them again first); records fetched
        past those positions are fetched again."""

    def lag(self) -> Mapping[TopicPartition, int]:
        """Per partition, records not fetched yet."""

    def caught_up(self) -> bool:
        """Whether nothing else is on its way: every assigned partition, none paused, was
        fetched to its end as last known, and nothing fetched waits to be handed out."""


class PositionNotes(Protocol):
    """What a commit records besides a position: the canary share in effect there
    (``workers.intake.canary.Split``)."""

    def note(self, tp: TopicPartition, position: int) -> str:
        """The metadata to commit with ``position`` of ``tp``."""

    def resume(self, tp: TopicPartition, position: int, note: str | None) -> None:
        """``tp`` is read from ``position`` on; ``note`` is the metadata committed with it
        (None: nothing was committed)."""


class ResultSink(Protocol):
    """Where answers go: Redis and the reply topic (``workers.publish.publisher.Publisher``)."""

    async def publish(self, outbox: Outbox) -> PublishReport:
        """Return once every result and dead letter in ``outbox`` is durable."""


class Chain(Protocol):
    """The pipeline step of a publish (``workers.chain.joins.Joins``): run on an outbox
    before its results are written."""

    async def settle(self, outbox: Outbox) -> None:
        """Move ``outbox.parents`` and ``outbox.children`` into joins; add the child
        requests to send and the parents' results that are complete."""


class PartitionCommit(NamedTuple):
    """What one transaction writes: a request partition's results, dead letters and position."""

    partition: TopicPartition
    outbox: Outbox  # results and dead letters of records of ``partition`` only
    position: int  # the partition's next position: every record below it is answered


class Committed(enum.Enum):
    """How a partition's transaction ended."""

    YES = "committed"
    LOST = "lost"  # failed or fenced: read the partition again from its committed position
    CLOSED = "closed"  # the partition was revoked meanwhile: its next owner answers it


class TransactionalSink(Protocol):
    """Where answers go in exactly-once delivery (``delivery.transactions``)."""

    async def publish(self, parts: Sequence[PartitionCommit]) -> tuple[list[Committed], int]:
        """Write results to Redis (first answer wins), then each part in one transaction.

        Returns how each part's transaction ended, and how many results Redis had already.
        """

    async def close(self, partitions: Collection[TopicPartition]) -> None:
        """Stop writing for ``partitions`` (revoked); a transaction in progress is abandoned."""

    async def aclose(self) -> None:
        """Stop writing for every partition."""
