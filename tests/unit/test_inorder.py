"""InOrder: a partition's answers are released only as a prefix, span by span."""

from __future__ import annotations

from schemas import ContentType, ErrorCode
from schemas.fastpath import FastMeta
from tests.fakes import FakeRecord
from workers.delivery.inorder import InOrder
from workers.offsets import OffsetTracker, Span
from workers.types import BatchTiming, Item, Outcome, Refusal, TopicPartition

TP0: TopicPartition = ("t", 0)
TP1: TopicPartition = ("t", 1)
TIMING = BatchTiming(0.0, 1.0, 1.0, 1)


def fetch(
    tracker: OffsetTracker[TopicPartition], tp: TopicPartition, first: int, count: int
) -> list[Item]:
    """``count`` records of ``tp`` from ``first``, fetched together: one span."""
    span = tracker.open(tp, first, first + count - 1, count)
    return [item(tp, span, first + n) for n in range(count)]


def item(tp: TopicPartition, span: Span, offset: int) -> Item:
    meta = FastMeta(f"{tp[0]}{tp[1]}-{offset}", ContentType.TEXT, {}, *([None] * 6))
    return Item(FakeRecord(tp[0], tp[1], offset), span, meta, 0.0, None)


def ok(items: list[Item]) -> Outcome:
    return Outcome(items, [i.record.offset for i in items], TIMING)


def refused(items: list[Item]) -> Outcome:
    return Outcome(
        refused=[
            Refusal(i.record, i.span, ErrorCode.bad_request, "bad", None, i.meta.id, 0.0)
            for i in items
        ]
    )


def offsets(outcomes: list[Outcome]) -> list[int]:
    return sorted(
        [i.record.offset for o in outcomes for i in o.answered]
        + [r.record.offset for o in outcomes for r in o.refused]
    )


def test_nothing_is_released_before_every_earlier_record_is_answered() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    held = InOrder(tracker)
    first, second = fetch(tracker, TP0, 0, 3), fetch(tracker, TP0, 3, 3)
    held.add([ok(second)])  # the later span is done first
    assert held.release() == []
    held.add([refused(first[1:2]), ok(first[:1])])
    assert held.release() == []  # first[2] still open
    held.add([ok(first[2:])])
    (release,) = held.release()
    assert release.partition == TP0
    assert release.position == 6
    assert release.spans == [first[0].span, second[0].span]
    assert offsets(release.outcomes) == list(range(6))
    assert len(held) == 0


def test_a_prefix_is_released_and_the_rest_waits() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    held = InOrder(tracker)
    first, second, third = (fetch(tracker, TP0, n, 2) for n in (0, 2, 4))
    held.add([ok(first), ok(third)])
    (release,) = held.release()
    assert release.position == 2
    assert offsets(release.outcomes) == [0, 1]
    # As the delivery does once the transaction committed:
    for span in release.spans:
        tracker.finish(span, span.open)
    held.add([ok(second)])
    (release,) = held.release()
    assert release.position == 6
    assert offsets(release.outcomes) == [2, 3, 4, 5]


def test_partitions_are_released_independently_with_their_timing() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    held = InOrder(tracker)
    zero, one = fetch(tracker, TP0, 10, 2), fetch(tracker, TP1, 0, 2)
    held.add([ok(zero + one)])  # one batch of both partitions
    releases = {r.partition: r for r in held.release()}
    assert {tp: r.position for tp, r in releases.items()} == {TP0: 12, TP1: 2}
    for release in releases.values():
        assert all(o.timing is TIMING for o in release.outcomes)
        assert all(len(o.answered) == len(o.outputs) for o in release.outcomes)


def test_forget_drops_a_partition_and_answers_of_forgotten_spans_are_ignored() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    held = InOrder(tracker)
    zero, one = fetch(tracker, TP0, 0, 2), fetch(tracker, TP1, 0, 2)
    held.add([ok(zero[:1]), ok(one[:1])])
    held.forget(TP0)
    tracker.forget(TP0)
    held.add([ok(zero[1:]), ok(one[1:])])  # the rest of TP0 arrives after it was dropped
    (release,) = held.release()
    assert release.partition == TP1
    assert len(held) == 0
