"""Priority lanes: the highest lane goes first, every lane gets its share, pauses follow weights."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import topics_for
from workers.batching.batcher import CloseReason
from workers.batching.lanes import LaneBatcher, LaneScheduler, LaneSpec, paused_lanes
from workers.cli import add_arguments, settings_from_args
from workers.config.worker import WorkerSettings


@dataclass(frozen=True)
class Job:
    lane: int
    n: int
    deadline: float | None = None


def make(weights: list[int], max_batch_size: int = 4, max_delay: float = 0.010) -> LaneBatcher[Job]:
    return LaneBatcher(weights, max_batch_size, max_delay, deadline_of=lambda job: job.deadline)


def jobs(lane: int, count: int, first: int = 0) -> list[Job]:
    return [Job(lane, n) for n in range(first, first + count)]


def test_the_highest_lane_with_work_goes_first() -> None:
    batcher = make([8, 1])
    batcher.add_many(1, jobs(1, 40), now=0.0)
    batcher.add_many(0, jobs(0, 2), now=0.0)
    batch = batcher.poll(0.0)
    assert batch is not None
    assert batch.items == jobs(0, 2)  # not full, not timed out: closed because lane 1 waits
    assert batch.reason is CloseReason.BACKLOG
    batch = batcher.poll(0.0)
    assert batch is not None
    assert {job.lane for job in batch.items} == {1}


def test_a_lane_alone_waits_for_its_batch_to_fill_as_usual() -> None:
    batcher = make([8, 1], max_delay=0.5)
    batcher.add_many(1, jobs(1, 2), now=0.0)
    assert batcher.poll(0.1) is None
    assert batcher.next_deadline() == 0.5
    batch = batcher.poll(0.5)
    assert batch is not None
    assert batch.reason is CloseReason.TIMEOUT


def test_full_only_takes_a_full_lane_while_the_others_wait() -> None:
    batcher = make([8, 1], max_batch_size=4)
    batcher.add_many(0, jobs(0, 2), now=0.0)
    batcher.add_many(1, jobs(1, 5), now=0.0)
    batch = batcher.poll(9.0, full_only=True)  # lane 0 is contended and timed out, not full
    assert batch is not None
    assert batch.items == jobs(1, 4)
    assert batch.reason is CloseReason.FULL
    assert batcher.poll(9.0, full_only=True) is None
    assert len(batcher) == 3


def test_a_saturated_high_lane_leaves_the_low_lane_one_batch_in_nine() -> None:
    batcher = make([8, 1], max_batch_size=2)
    batcher.add_many(0, jobs(0, 1000), now=0.0)
    batcher.add_many(1, jobs(1, 1000), now=0.0)
    lanes = []
    for _ in range(90):
        batch = batcher.poll(0.0)
        assert batch is not None
        lanes.append(batch.items[0].lane)
        assert {job.lane for job in batch.items} == {lanes[-1]}  # one lane per batch
    assert lanes.count(1) == 10
    # The low lane is never passed over more than 8 times in a row.
    runs = [len(list(group)) for lane, group in itertools.groupby(lanes) if lane == 0]
    assert max(runs) == 8


def test_order_is_kept_within_each_lane() -> None:
    batcher = make([2, 1], max_batch_size=3)
    batcher.add_many(0, jobs(0, 30), now=0.0)
    batcher.add_many(1, jobs(1, 30), now=0.0)
    seen: dict[int, list[int]] = {0: [], 1: []}
    while (batch := batcher.poll(1.0)) is not None:
        for job in batch.items:
            seen[job.lane].append(job.n)
    assert seen == {0: list(range(30)), 1: list(range(30))}
    assert len(batcher) == 0


def test_expired_items_of_every_lane_leave_with_the_next_poll() -> None:
    batcher = make([4, 1], max_delay=60.0)
    batcher.add_many(0, [Job(0, 1), Job(0, 2, deadline=1.0)], now=0.0)
    batcher.add_many(1, [Job(1, 1, deadline=1.0), Job(1, 2)], now=0.0)
    batch = batcher.poll(2.0)
    assert batch is not None
    assert batch.items == [Job(0, 1)]
    assert sorted(batch.expired, key=lambda job: job.lane) == [
        Job(0, 2, deadline=1.0),
        Job(1, 1, deadline=1.0),
    ]
    assert batcher.poll(2.0) is None  # alone in its lane now: it waits for max_delay
    batch = batcher.poll(60.0)
    assert batch is not None
    assert batch.items == [Job(1, 2)]
    assert batch.expired == []


def test_only_expired_items_come_back_as_a_deadline_batch() -> None:
    batcher = make([4, 1], max_delay=60.0)
    batcher.add_many(1, [Job(1, 1, deadline=1.0)], now=0.0)
    batch = batcher.poll(1.5)
    assert batch is not None
    assert (batch.items, batch.reason) == ([], CloseReason.DEADLINE)
    assert batch.expired == [Job(1, 1, deadline=1.0)]


def test_withdraw_takes_unwanted_items_from_every_lane_keeping_order() -> None:
    batcher = make([4, 1], max_batch_size=10)
    batcher.add_many(0, jobs(0, 5), now=0.0)
    batcher.add_many(1, jobs(1, 5), now=0.0)
    gone = batcher.withdraw(lambda job: job.n % 2 == 1)
    assert gone == [Job(0, 1), Job(0, 3), Job(1, 1), Job(1, 3)]
    batch = batcher.poll(1.0)
    assert batch is not None
    assert batch.items == [Job(0, 0), Job(0, 2), Job(0, 4)]


def test_drain_closes_every_lane_highest_first() -> None:
    batcher = make([4, 1], max_batch_size=10, max_delay=60.0)
    batcher.add_many(1, jobs(1, 2), now=0.0)
    batcher.add_many(0, jobs(0, 2), now=0.0)
    drained = batcher.drain(0.0)
    assert [job for batch in drained for job in batch.items] == jobs(0, 2) + jobs(1, 2)


def test_one_lane_is_a_plain_batcher() -> None:
    batcher = make([1], max_delay=0.5)
    batcher.add_many(0, jobs(0, 2), now=0.0)
    assert batcher.poll(0.2) is None
    batch = batcher.poll(0.2, backlog=True)
    assert batch is not None
    assert batch.items == jobs(0, 2)


@given(
    weights=st.lists(st.integers(min_value=1, max_value=12), min_size=2, max_size=4),
    waiting=st.data(),
)
def test_no_lane_with_work_waits_longer_than_its_bound(
    weights: list[int], waiting: st.DataObject
) -> None:
    scheduler = LaneScheduler(weights)
    total = sum(weights)
    assert scheduler.max_skips == [-(-total // w) - 1 for w in weights]
    skipped = [0] * len(weights)
    for _ in range(300):
        due = waiting.draw(st.lists(st.booleans(), min_size=len(weights), max_size=len(weights)))
        chosen = scheduler.pick(due)
        if not any(due):
            assert chosen is None
            continue
        assert chosen is not None
        assert due[chosen]
        for lane, ready in enumerate(due):
            skipped[lane] = skipped[lane] + 1 if ready and lane != chosen else 0
            # Lanes owed their turn at the same moment go one after another.
            assert skipped[lane] <= scheduler.max_skips[lane] + len(weights) - 2


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="weight"):
        LaneScheduler([1, 0])


def test_nothing_pauses_below_the_cap() -> None:
    assert paused_lanes([90, 9], 100, [8, 1]) == [False, False]


def test_at_the_cap_only_lanes_holding_their_share_pause() -> None:
    # A low-lane backlog fills the budget: the high lane still fetches.
    assert paused_lanes([0, 100], 100, [8, 1]) == [False, True]
    # Both lanes busy: each is held to its share.
    assert paused_lanes([89, 12], 100, [8, 1]) == [True, True]
    assert paused_lanes([80, 20], 100, [8, 1]) == [False, True]


def test_one_lane_pauses_at_the_cap() -> None:
    assert paused_lanes([99], 100, [1]) == [False]
    assert paused_lanes([100], 100, [1]) == [True]


def test_lanes_setting_from_a_flag_or_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "digits", "--lanes", "urgent:16,high:4,default,bulk"])
    settings = settings_from_args(args)
    assert settings.request_lanes == (
        LaneSpec("urgent", 16),
        LaneSpec("high", 4),
        LaneSpec("default", 1),
        LaneSpec("bulk", 1),
    )
    monkeypatch.setenv("CONVEYOR_LANES", "high:8")
    assert WorkerSettings(model="digits").request_lanes == (
        LaneSpec("high", 8),
        LaneSpec("default", 1),
    )
    monkeypatch.delenv("CONVEYOR_LANES")
    assert WorkerSettings(model="digits").request_lanes == (LaneSpec("default", 1),)


@pytest.mark.parametrize(
    ("lanes", "problem"),
    [
        ("High", "lane name"),
        ("high:x", "weight after ':'"),
        ("high:0", "weight must be 1 to 1000"),
        ("high,high", "unique"),
    ],
)
def test_bad_lanes_are_refused_naming_the_problem(lanes: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        WorkerSettings(model="digits", lanes=lanes)


def test_lane_topics_sit_beside_the_request_topic() -> None:
    topics = topics_for("digits")
    assert topics.lane("high") == "conveyor.digits.requests.high"
    assert topics.lane("default") == topics.requests
    with pytest.raises(ValueError, match="lane name"):
        topics.lane("a.b")
