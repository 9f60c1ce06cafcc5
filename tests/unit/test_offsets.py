"""OffsetTracker: commit positions never pass an unfinished record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.offsets import OffsetTracker

TP = ("conveyor.m.requests", 0)
TP2 = ("conveyor.m.requests", 1)


def test_position_is_lowest_unfinished_offset() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.track(TP, offset)
    assert tracker.committable() == {}  # nothing finished yet
    assert tracker.done(TP, 12)
    assert tracker.done(TP, 11)
    assert tracker.committable() == {}  # 10 still in flight
    assert tracker.done(TP, 10)
    assert tracker.committable() == {TP: 13}
    assert tracker.in_flight(TP) == 0


def test_gaps_in_offsets() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    for offset in (3, 7, 20):  # compacted away or transaction markers in between
        tracker.track(TP, offset)
    tracker.done(TP, 3)
    assert tracker.committable() == {TP: 7}
    tracker.done(TP, 20)
    assert tracker.committable() == {TP: 7}
    tracker.done(TP, 7)
    assert tracker.committable() == {TP: 21}


def test_only_advanced_partitions_are_committable() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.track(TP, 0)
    tracker.track(TP2, 100)
    tracker.done(TP, 0)
    tracker.done(TP2, 100)
    assert tracker.committable() == {TP: 1, TP2: 101}
    tracker.mark_committed({TP: 1, TP2: 101})
    assert tracker.committable() == {}
    tracker.track(TP, 1)
    tracker.done(TP, 1)
    assert tracker.committable() == {TP: 2}


def test_late_commit_ack_does_not_move_back() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    for offset in range(3):
        tracker.track(TP, offset)
        tracker.done(TP, offset)
    tracker.mark_committed({TP: 3})
    tracker.mark_committed({TP: 1})  # an older commit acknowledged after the newer one
    assert tracker.committable() == {}


def test_done_of_unknown_offset_changes_nothing() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.track(TP, 5)
    assert not tracker.done(TP, 4)  # never tracked
    assert not tracker.done(TP2, 5)  # unknown partition
    assert tracker.done(TP, 5)
    assert not tracker.done(TP, 5)  # twice
    assert tracker.committable() == {TP: 6}


def test_offsets_must_increase() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.track(TP, 5)
    with pytest.raises(ValueError, match="must increase"):
        tracker.track(TP, 5)


def test_in_flight_and_pending_partitions() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.track(TP, 0)
    tracker.track(TP, 1)
    tracker.track(TP2, 0)
    assert tracker.in_flight() == 3
    assert tracker.in_flight(TP) == 2
    assert tracker.in_flight(("other", 0)) == 0
    tracker.done(TP2, 0)
    assert tracker.pending_partitions() == {TP}


def test_forget_drops_the_partition() -> None:
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    tracker.track(TP, 0)
    tracker.track(TP2, 0)
    tracker.done(TP2, 0)
    tracker.forget(TP)
    assert not tracker.done(TP, 0)  # finished after its partition was lost
    assert tracker.committable() == {TP2: 1}
    assert tracker.pending_partitions() == set()
    tracker.mark_committed({TP: 1})  # ignored for a forgotten partition
    tracker.track(TP, 0)  # reassigned later: starts afresh, re-reading from 0 is allowed
    assert tracker.in_flight(TP) == 1


@given(
    first=st.integers(min_value=0, max_value=10**12),
    gaps=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=60),
    commit_as_we_go=st.booleans(),
    data=st.data(),
)
def test_never_commits_past_an_unfinished_offset(
    first: int, gaps: list[int], commit_as_we_go: bool, data: st.DataObject
) -> None:
    """Random interleavings of track and out-of-order done over offsets with gaps."""
    offsets = [first + sum(gaps[:i]) for i in range(len(gaps))]
    to_track = list(offsets)
    unfinished: list[int] = []
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    last_committed = first
    while to_track or unfinished:
        if to_track and (not unfinished or data.draw(st.booleans())):
            offset = to_track.pop(0)
            tracker.track(TP, offset)
            unfinished.append(offset)
        else:
            offset = unfinished.pop(data.draw(st.integers(0, len(unfinished) - 1)))
            assert tracker.done(TP, offset)
        assert tracker.in_flight(TP) == len(unfinished)
        expected = (
            min(unfinished) if unfinished else max(offsets[: len(offsets) - len(to_track)]) + 1
        )
        position = tracker.committable().get(TP)
        if position is None:
            assert expected <= last_committed  # nothing new, and nothing held back
        else:
            assert position == expected > last_committed
            if commit_as_we_go:
                tracker.mark_committed({TP: position})
                last_committed = position
    assert tracker.committable().get(TP, last_committed) == offsets[-1] + 1
