"""OffsetTracker: commit positions never pass an unfinished record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.offsets import OffsetTracker

TP = ("conveyor.m.requests", 0)
TP2 = ("conveyor.m.requests", 1)


def test_position_waits_for_the_oldest_open_span() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    first = tracker.open(TP, 10, 12, 3)
    second = tracker.open(TP, 13, 14, 2)
    assert tracker.committable() == {}  # nothing finished yet
    tracker.finish(second, 2)
    assert tracker.committable() == {}  # the first span is still open
    tracker.finish(first, 2)
    assert tracker.committable() == {}
    assert tracker.in_flight(TP) == 1
    tracker.finish(first)
    assert tracker.committable() == {TP: 15}
    assert tracker.in_flight(TP) == 0


def test_a_finished_span_lets_the_position_move_to_the_next_one() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    first = tracker.open(TP, 0, 9, 10)
    tracker.open(TP, 10, 19, 10)
    tracker.finish(first, 10)
    assert tracker.committable() == {TP: 10}


def test_gaps_in_offsets() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    span = tracker.open(TP, 3, 20, 3)  # 3, 7 and 20: compacted away or markers between
    tracker.finish(span, 3)
    assert tracker.committable() == {TP: 21}


def test_only_advanced_partitions_are_committable() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.finish(tracker.open(TP, 0, 0, 1))
    tracker.finish(tracker.open(TP2, 100, 100, 1))
    assert tracker.committable() == {TP: 1, TP2: 101}
    tracker.mark_committed({TP: 1, TP2: 101})
    assert tracker.committable() == {}
    tracker.finish(tracker.open(TP, 1, 1, 1))
    assert tracker.committable() == {TP: 2}


def test_late_commit_ack_does_not_move_back() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.finish(tracker.open(TP, 0, 2, 3), 3)
    tracker.mark_committed({TP: 3})
    tracker.mark_committed({TP: 1})  # an older commit acknowledged after the newer one
    assert tracker.committable() == {}


def test_spans_must_not_go_back() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.open(TP, 5, 9, 5)
    with pytest.raises(ValueError, match="must increase"):
        tracker.open(TP, 9, 12, 4)
    with pytest.raises(ValueError, match="needs records"):
        tracker.open(TP2, 1, 0, 1)


def test_finishing_more_than_is_open_is_a_bug() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    span = tracker.open(TP, 0, 1, 2)
    with pytest.raises(ValueError, match="only 2 are open"):
        tracker.finish(span, 3)


def test_forget_drops_a_partition_and_ignores_its_late_finishes() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    old = tracker.open(TP, 0, 4, 5)
    tracker.forget(TP)
    assert tracker.in_flight() == 0
    assert tracker.committable() == {}
    # The partition comes back (re-assigned): reading restarts at the committed offset.
    new = tracker.open(TP, 0, 4, 5)
    tracker.finish(old, 5)  # a result of the old reading became durable late: ignored
    assert tracker.in_flight(TP) == 5
    tracker.finish(new, 5)
    assert tracker.committable() == {TP: 5}
    tracker.mark_committed({TP: 5})
    tracker.forget(TP2)  # unknown partitions are fine


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_position_never_passes_an_unfinished_record(sizes: list[int], order: object) -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    records = []
    offset = 0
    for size in sizes:
        span = tracker.open(TP, offset, offset + size - 1, size)
        records += [(span, offset + i) for i in range(size)]
        offset += size
    order.shuffle(records)  # type: ignore[attr-defined]
    unfinished = {o for _, o in records}
    for span, record_offset in records:
        tracker.finish(span)
        unfinished.discard(record_offset)
        position = tracker.committable().get(TP)
        if position is not None:
            assert all(o >= position for o in unfinished)
            tracker.mark_committed({TP: position})
    assert tracker.committable() == {}
    assert tracker.in_flight() == 0
    assert tracker.open(TP, offset, offset, 1).first == offset
