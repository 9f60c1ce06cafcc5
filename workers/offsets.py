"""Which Kafka offsets are safe to commit, given records that finish out of order.

A record is *in flight* from the moment the consumer hands it over until its
result is durable (written to Redis and acknowledged on the reply topic). Kafka
commits a single position per partition, "everything below this is done", so the
position may only advance up to the lowest offset still in flight. Committing
any further would lose that record if the worker died; committing less only
causes redelivery, which is harmless because results are idempotent by request id.

This module is pure bookkeeping: no Kafka client, no clock, no I/O. The consumer
calls `track`, the publisher calls `done`, and the commit step asks for
`committable()` positions and reports back with `mark_committed`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["OffsetTracker"]

TP = TypeVar("TP", bound=Hashable)


@dataclass(slots=True)
class _Partition:
    """Offsets of one partition."""

    # Tracked offsets in arrival (= ascending) order; finished ones are popped only
    # once they reach the front, so the front is always the lowest unfinished offset.
    order: deque[int] = field(default_factory=deque)
    # Offsets still in flight, for O(1) membership checks and counting.
    pending: set[int] = field(default_factory=set)
    # Highest offset ever tracked; the position is highest + 1 once nothing is in flight.
    highest: int = -1
    # Position last reported by mark_committed (or the first tracked offset,
    # where the consumer started reading: nothing new to commit until it moves).
    committed: int = -1

    def position(self) -> int:
        return self.order[0] if self.order else self.highest + 1


class OffsetTracker(Generic[TP]):
    """Per-partition in-flight offsets and the commit position they allow.

    Partitions are keyed by any hashable value (an aiokafka ``TopicPartition``, or a
    ``(topic, partition)`` tuple). Every operation is amortised O(1).
    """

    def __init__(self) -> None:
        self._partitions: dict[TP, _Partition] = {}

    def track(self, tp: TP, offset: int) -> None:
        """Record that ``offset`` of ``tp`` was received and is now in flight.

        Offsets of one partition must arrive in increasing order; gaps are fine
        (compacted topics and transaction markers leave them).
        Raises ``ValueError`` for an offset at or below one already tracked, since
        that means the consumer re-read records without `forget` in between.
        """
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition(committed=offset)
        if offset <= part.highest:
            raise ValueError(
                f"offset {offset} of {tp!r} arrived after offset {part.highest}; "
                "offsets of a partition must increase (call forget() after a seek or rebalance)"
            )
        part.order.append(offset)
        part.pending.add(offset)
        part.highest = offset

    def done(self, tp: TP, offset: int) -> bool:
        """Record that the result of ``offset`` of ``tp`` is durably written.

        Calls may come in any order. Returns False, and changes nothing, when the
        offset is not in flight: already done, never tracked, or its partition was
        forgotten (a result that finished after its partition was revoked or lost).
        """
        part = self._partitions.get(tp)
        if part is None or offset not in part.pending:
            return False
        part.pending.remove(offset)
        # Each offset is appended and popped once, so this loop is amortised O(1).
        order = part.order
        while order and order[0] not in part.pending:
            order.popleft()
        return True

    def committable(self) -> dict[TP, int]:
        """Positions to commit: per partition, the lowest in-flight offset, or the
        highest tracked offset + 1 when none is in flight (Kafka's "next offset to
        read"). Only partitions whose position moved past the last `mark_committed`
        value are listed, so an idle worker commits nothing.
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
            return sum(len(part.pending) for part in self._partitions.values())
        part = self._partitions.get(tp)
        return 0 if part is None else len(part.pending)

    def pending_partitions(self) -> set[TP]:
        """Partitions that still have records in flight."""
        return {tp for tp, part in self._partitions.items() if part.pending}

    def forget(self, tp: TP) -> None:
        """Drop all state of ``tp``: call it once a revoked partition is drained and
        committed. Records of ``tp`` still in flight are dropped too (their later
        `done` calls return False); that is only right for a partition already lost.
        """
        self._partitions.pop(tp, None)
