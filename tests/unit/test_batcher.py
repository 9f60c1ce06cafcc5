"""Batcher: batches close on size, timeout or backlog; expired items never reach the model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.batching.batcher import Batch, Batcher, CloseReason


@dataclass(frozen=True)
class Job:
    n: int
    deadline: float | None = None


def make(max_batch_size: int = 4, max_delay: float = 0.010) -> Batcher[Job]:
    return Batcher(max_batch_size, max_delay, deadline_of=lambda job: job.deadline)


def jobs(*ns: int) -> list[Job]:
    return [Job(n) for n in ns]


def test_full_batch_closes_at_once() -> None:
    batcher = make(max_batch_size=3)
    batcher.add_many(jobs(1, 2, 3, 4), now=1.0)
    batch = batcher.poll(1.0)
    assert batch is not None
    assert batch.items == jobs(1, 2, 3)
    assert batch.reason is CloseReason.FULL
    assert batch.expired == []
    assert len(batcher) == 1


def test_partial_batch_waits_for_max_delay() -> None:
    batcher = make(max_delay=0.5)
    batcher.add(Job(1), now=10.0)
    batcher.add(Job(2), now=10.2)
    assert batcher.poll(10.3) is None
    assert batcher.next_deadline() == 10.5
    assert batcher.poll(10.499) is None
    batch = batcher.poll(10.5)
    assert batch is not None
    assert batch.items == jobs(1, 2)
    assert batch.reason is CloseReason.TIMEOUT
    assert batcher.next_deadline() is None
    assert batcher.poll(99.0) is None


def test_full_only_closes_a_full_batch_and_nothing_else() -> None:
    batcher = make(max_batch_size=3, max_delay=0.5)
    batcher.add_many(jobs(1, 2), now=0.0)
    assert batcher.poll(9.0, backlog=True, full_only=True) is None  # timed out, backlog: held
    assert batcher.due(9.0, backlog=True, full_only=True) is None
    batcher.add(Job(3), now=9.0)
    batch = batcher.poll(9.0, full_only=True)
    assert batch is not None
    assert batch.items == jobs(1, 2, 3)
    assert batch.reason is CloseReason.FULL


def test_full_only_still_hands_back_expired_items() -> None:
    batcher = make(max_batch_size=3)
    batcher.add(Job(1, deadline=1.0), now=0.0)
    batcher.add(Job(2), now=0.0)
    batch = batcher.poll(2.0, full_only=True)
    assert batch is not None
    assert (batch.items, batch.expired, batch.reason) == ([], [Job(1, 1.0)], CloseReason.DEADLINE)
    assert len(batcher) == 1


def test_backlog_skips_the_timer() -> None:
    batcher = make(max_delay=60.0)
    batcher.add(Job(1), now=0.0)
    assert batcher.poll(0.0, backlog=False) is None
    batch = batcher.poll(0.0, backlog=True)
    assert batch is not None
    assert batch.reason is CloseReason.BACKLOG
    assert batch.items == jobs(1)
    assert batcher.poll(0.0, backlog=True) is None  # nothing queued: no empty batch


def test_an_idle_source_skips_the_timer_unless_only_full_batches_may_go() -> None:
    batcher = make(max_batch_size=3, max_delay=60.0)
    batcher.add(Job(1), now=0.0)
    assert batcher.poll(0.0) is None  # something may be on its way: wait for the timer
    assert batcher.poll(0.0, idle=True, full_only=True) is None  # the model stage is full
    assert batcher.due(0.0, idle=True) is CloseReason.IDLE
    batch = batcher.poll(0.0, idle=True)
    assert batch is not None
    assert (batch.items, batch.reason) == (jobs(1), CloseReason.IDLE)
    assert batcher.poll(0.0, idle=True) is None  # nothing queued: no empty batch
    # A backlog or a full batch is named as before, idle or not.
    batcher.add(Job(2), now=1.0)
    assert batcher.due(1.0, backlog=True, idle=True) is CloseReason.BACKLOG
    batcher.add_many(jobs(3, 4), now=1.0)
    assert batcher.due(1.0, idle=True) is CloseReason.FULL


def test_full_wins_over_timeout_and_backlog() -> None:
    batcher = make(max_batch_size=2, max_delay=1.0)
    batcher.add_many(jobs(1, 2), now=0.0)
    batch = batcher.poll(5.0, backlog=True)
    assert batch is not None
    assert batch.reason is CloseReason.FULL


def test_expired_items_are_taken_out_wherever_they_stand() -> None:
    batcher = make(max_batch_size=4, max_delay=1.0)
    batcher.add_many([Job(1), Job(2, deadline=0.5), Job(3), Job(4, deadline=5.0)], now=0.0)
    batch = batcher.poll(0.5)  # Job 2 expires at 0.5 sharp; the batch is not due yet
    assert batch is not None
    assert batch.items == []
    assert batch.expired == [Job(2, deadline=0.5)]
    assert batch.reason is CloseReason.DEADLINE
    assert len(batcher) == 3
    batch = batcher.poll(1.0)
    assert batch is not None
    assert batch.items == [Job(1), Job(3), Job(4, deadline=5.0)]
    assert batch.expired == []


def test_expired_items_come_with_a_due_batch() -> None:
    batcher = make(max_batch_size=2, max_delay=1.0)
    batcher.add_many([Job(1, deadline=0.1), Job(2), Job(3)], now=0.0)
    batch = batcher.poll(0.2)
    assert batch is not None
    assert batch.items == jobs(2, 3)
    assert batch.expired == [Job(1, deadline=0.1)]
    assert batch.reason is CloseReason.FULL


def test_next_deadline_includes_item_deadlines() -> None:
    batcher = make(max_delay=1.0)
    batcher.add(Job(1), now=0.0)
    batcher.add(Job(2, deadline=0.25), now=0.1)
    assert batcher.next_deadline() == 0.25
    batch = batcher.poll(0.25)
    assert batch is not None
    assert batch.expired == [Job(2, deadline=0.25)]
    assert batcher.next_deadline() == 1.0


def test_deadline_of_an_item_already_batched_is_forgotten() -> None:
    batcher = make(max_batch_size=1, max_delay=1.0)
    batcher.add(Job(1, deadline=0.5), now=0.0)
    batcher.add(Job(2), now=0.0)
    first = batcher.poll(0.0)
    assert first is not None
    assert first.items == [Job(1, deadline=0.5)]
    assert batcher.next_deadline() == 1.0  # not 0.5: Job 1 has left
    batch = batcher.poll(0.6)
    assert batch is None or batch.expired == []


def test_drain_returns_everything_in_order() -> None:
    batcher = make(max_batch_size=2, max_delay=60.0)
    batcher.add_many([Job(1), Job(2, deadline=1.0), Job(3), Job(4), Job(5)], now=0.0)
    batches = batcher.drain(2.0)
    assert [b.items for b in batches] == [jobs(1, 3), jobs(4, 5)]
    assert [b.expired for b in batches] == [[Job(2, deadline=1.0)], []]
    assert {b.reason for b in batches} == {CloseReason.DRAIN}
    assert batcher.drain(3.0) == []
    assert len(batcher) == 0


def test_drain_with_only_expired_items() -> None:
    batcher = make()
    batcher.add(Job(1, deadline=1.0), now=0.0)
    [batch] = batcher.drain(2.0)
    assert batch.items == []
    assert batch.expired == [Job(1, deadline=1.0)]


def test_no_deadline_function_means_nothing_expires() -> None:
    batcher: Batcher[int] = Batcher(max_batch_size=2, max_delay=1.0)
    batcher.add(1, now=0.0)
    assert batcher.next_deadline() == 1.0
    assert batcher.poll(1e9) == Batch([1], [], CloseReason.TIMEOUT)


def test_zero_delay_closes_at_once() -> None:
    batcher: Batcher[int] = Batcher(max_batch_size=8, max_delay=0.0)
    batcher.add(1, now=3.0)
    batch = batcher.poll(3.0)
    assert batch is not None
    assert batch.reason is CloseReason.TIMEOUT


@pytest.mark.parametrize(("size", "delay"), [(0, 1.0), (1, -0.1)])
def test_rejects_bad_limits(size: int, delay: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        Batcher[int](size, delay)


# One step of a random run: ("add", count, seconds since the previous step, deadline
# offset or None), or ("poll", 0, seconds since the previous step, backlog flag).
Step = tuple[str, int, float, float | bool | None]

steps = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(min_value=1, max_value=12),
        st.floats(min_value=0.0, max_value=0.02),
        st.none() | st.floats(min_value=0.0, max_value=0.05),
    ),
    st.tuples(st.just("poll"), st.just(0), st.floats(min_value=0.0, max_value=0.02), st.booleans()),
)


@given(
    max_batch_size=st.integers(min_value=1, max_value=8),
    max_delay=st.floats(min_value=0.0, max_value=0.03),
    run=st.lists(steps, max_size=60),
)
def test_random_runs_keep_every_item_once_in_order(
    max_batch_size: int, max_delay: float, run: list[Step]
) -> None:
    batcher = make(max_batch_size, max_delay)
    now = 100.0
    added: list[Job] = []
    arrived: dict[Job, float] = {}
    out: list[Batch[Job]] = []
    for kind, count, dt, extra in run:
        now += dt
        if kind == "add":
            deadline = None if extra is None else now + float(extra)
            new = [Job(len(added) + i, deadline) for i in range(count)]
            batcher.add_many(new, now)
            added.extend(new)
            arrived.update(dict.fromkeys(new, now))
            continue
        queued = len(batcher)
        oldest = min((arrived[j] for j in added if j not in _seen(out)), default=None)
        batch = batcher.poll(now, backlog=bool(extra))
        if batch is None:
            # Nothing was due: not full, not timed out, no backlog, nothing expired.
            assert queued < max_batch_size
            assert oldest is None or now < oldest + max_delay
            assert not (extra and queued)
            assert not any(
                j.deadline is not None and j.deadline <= now for j in _pending(added, out)
            )
        else:
            _check_batch(batch, now, max_batch_size, max_delay, arrived)
            out.append(batch)
        deadline = batcher.next_deadline()
        if deadline is not None:
            # Sleeping exactly until next_deadline() is enough: a batch is then due.
            now = max(now, deadline)
            batch = batcher.poll(now)
            assert batch is not None
            _check_batch(batch, now, max_batch_size, max_delay, arrived)
            out.append(batch)
    out.extend(batcher.drain(now + 1.0))

    live = [j for b in out for j in b.items]
    expired = [j for b in out for j in b.expired]
    assert sorted(live + expired, key=lambda j: j.n) == added  # none lost, none twice
    assert live == sorted(live, key=lambda j: j.n)  # FIFO across batches
    assert all(j.deadline is not None for j in expired)
    assert all(len(b.items) <= max_batch_size for b in out)


def _seen(out: list[Batch[Job]]) -> set[Job]:
    return {j for b in out for j in (*b.items, *b.expired)}


def _pending(added: list[Job], out: list[Batch[Job]]) -> list[Job]:
    seen = _seen(out)
    return [j for j in added if j not in seen]


def _check_batch(
    batch: Batch[Job],
    now: float,
    max_batch_size: int,
    max_delay: float,
    arrived: dict[Job, float],
) -> None:
    assert len(batch.items) <= max_batch_size
    assert batch.items or batch.expired
    assert all(j.deadline is None or j.deadline > now for j in batch.items)
    assert all(j.deadline is not None and j.deadline <= now for j in batch.expired)
    if batch.reason is CloseReason.TIMEOUT:
        assert now >= arrived[batch.items[0]] + max_delay
    if batch.reason is CloseReason.FULL:
        assert len(batch.items) == max_batch_size
    if batch.reason is CloseReason.DEADLINE:
        assert batch.items == []
