"""Which Kafka offsets are safe to commit, given records that finish out of order.

A record is *in flight* from the moment the consumer hands it over until its
result is durable (written to Redis and acknowledged on the reply topic). Kafka
commits a single position per partition, "everything below this is done", so the
position may only advance past records that are all finished. Committing any
further would lose a record if the worker died; committing less only causes
redelivery, which is harmless because results are first-final-wins by request id.

The unit of bookkeeping is the *span*: the records of one partition that one
fetch returned, an offset range with a count of records still open. Finishing a
record is one decrement on its span, and a partition's position moves from span
to span, so the cost per record is a few attribute operations whatever the batch
sizes. The price is granularity: a partition's position stops at the first span
with an open record, so after a crash up to one fetch's worth of finished records
per partition is redelivered, the same order as one batch.

This module is pure bookkeeping: no Kafka client, no clock, no I/O. The fetch stage
calls `open`, the publish stage calls `finish`, and the commit step asks for
`committable()` positions and reports back with `mark_committed`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["OffsetTracker", "Span"]

TP = TypeVar("TP", bound=Hashable)


class _Partition:
    """Spans of one partition, oldest first, and its positions."""

    __slots__ = ("committed", "end", "forgotten", "open", "spans")

    def __init__(self, first: int) -> None:
        self.spans: deque[Span] = deque()
        self.end = first  # the offset after the last record fetched
        self.committed = first  # last position acknowledged (or where reading started)
        self.open = 0  # records in flight over all spans
        self.forgotten = False

    def position(self) -> int:
        spans = self.spans
        while spans and spans[0].open == 0:
            spans.popleft()
        return spans[0].first if spans else self.end


class Span:
    """Records ``first`` up to ``end`` (exclusive) of one partition, fetched together."""

    __slots__ = ("end", "first", "open", "partition")

    def __init__(self, partition: _Partition, first: int, end: int, count: int) -> None:
        self.partition = partition
        self.first = first
        self.end = end
        self.open = count  # records of this span not finished yet

    @property
    def released(self) -> bool:
        """Whether its partition was forgotten (revoked): its records are not ours."""
        return self.partition.forgotten


class OffsetTracker(Generic[TP]):
    """Per-partition spans in flight and the commit positions they allow.

    Partitions are keyed by any hashable value (an aiokafka ``TopicPartition``, or a
    ``(topic, partition)`` tuple). Every operation is amortised O(1) per record.
    """

    def __init__(self) -> None:
        self._partitions: dict[TP, _Partition] = {}

    def open(self, tp: TP, first: int, last: int, count: int) -> Span:
        """Track ``count`` records of ``tp`` with offsets ``first`` to ``last`` (inclusive,
        gaps allowed: compaction and transaction markers leave them), now in flight.

        Spans of one partition must come in offset order. Raises ``ValueError`` for a
        span that starts at or before the end of the last one: the consumer re-read
        records without `forget` in between.
        """
        if count < 1 or last < first:
            raise ValueError(f"a span needs records: {count} from {first} to {last}")
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition(first)
        elif first < part.end:
            raise ValueError(
                f"offset {first} of {tp!r} arrived after offset {part.end - 1}; offsets of "
                "a partition must increase (call forget() after a seek or rebalance)"
            )
        span = Span(part, first, last + 1, count)
        part.spans.append(span)
        part.end = last + 1
        part.open += count
        return span

    @staticmethod
    def finish(span: Span, count: int = 1) -> None:
        """Record that ``count`` records of ``span`` have durable results.

        A span of a forgotten partition (revoked, or lost) is left alone: its records
        belong to another worker now.
        """
        part = span.partition
        if part.forgotten:
            return
        if count > span.open:
            raise ValueError(f"{count} records finished, but only {span.open} are open")
        span.open -= count
        part.open -= count

    def committable(self) -> dict[TP, int]:
        """Positions to commit: per partition, the first offset of its oldest span with
        an open record, or the end of the last span when none is open. Only partitions
        whose position moved past the last `mark_committed` value are listed, so an
        idle worker commits nothing.
        """
        positions: dict[TP, int] = {}
        for tp, part in self._partitions.items():
            position = part.position()
            if position > part.committed:
                positions[tp] = position
        return positions

    def mark_committed(self, positions: Mapping[TP, int]) -> None:
        """Record positions the broker acknowledged as committed.

        Positions of forgotten partitions are ignored, and a position never moves
        backwards (an older commit that completes late does not undo a newer one).
        """
        for tp, position in positions.items():
            part = self._partitions.get(tp)
            if part is not None:
                part.committed = max(part.committed, position)

    def in_flight(self, tp: TP | None = None) -> int:
        """Records in flight in ``tp``, or in all partitions when ``tp`` is None."""
        if tp is None:
            return sum(part.open for part in self._partitions.values())
        part = self._partitions.get(tp)
        return 0 if part is None else part.open

    def in_flight_by_partition(self) -> Iterator[tuple[TP, int]]:
        """``(partition, records in flight)`` for every partition tracked."""
        for tp, part in self._partitions.items():
            yield tp, part.open

    def open_spans(self, tp: TP) -> Iterator[Span]:
        """The spans of ``tp`` with records in flight, oldest first."""
        part = self._partitions.get(tp)
        if part is None:
            return
        for span in part.spans:
            if span.open:
                yield span

    def forget(self, tp: TP) -> None:
        """Drop all state of ``tp``: call it once a revoked partition is drained and
        committed. Its records still in flight are dropped too (finishing them later
        changes nothing); that is only right for a partition no longer ours.
        """
        part = self._partitions.pop(tp, None)
        if part is not None:
            part.forgotten = True
