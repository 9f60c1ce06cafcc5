"""Batcher with a cost per item (text: padded lengths): a token budget, similar lengths
together, a stream's items in order, and every item out exactly once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.batching.batcher import Batch, Batcher, CloseReason


@dataclass(frozen=True)
class Text:
    n: int
    length: int  # its padded length: the cost of its row
    stream: str | None = None


def make(max_batch_size: int = 8, max_cost: int = 64, max_delay: float = 0.010) -> Batcher[Text]:
    return Batcher(
        max_batch_size,
        max_delay,
        cost_of=lambda text: text.length,
        max_cost=max_cost,
        group_of=lambda text: text.stream,
    )


def lengths(batch: Batch[Text] | None) -> list[int]:
    assert batch is not None
    return [text.length for text in batch.items]


def test_a_batch_closes_at_the_budget_of_rows_times_padded_length() -> None:
    batcher = make(max_cost=64)
    batcher.add_many([Text(i, 16) for i in range(5)], now=1.0)
    batch = batcher.poll(1.0)
    assert batch is not None
    assert batch.reason is CloseReason.BUDGET
    assert lengths(batch) == [16] * 4  # 4 rows × 16 = 64; a fifth would pass it
    assert len(batcher) == 1


def test_below_the_budget_the_batch_waits_for_the_timer() -> None:
    batcher = make(max_cost=64, max_delay=0.5)
    batcher.add_many([Text(0, 16), Text(1, 16)], now=1.0)
    assert batcher.poll(1.1) is None
    batch = batcher.poll(1.5)
    assert batch is not None
    assert batch.reason is CloseReason.TIMEOUT


def test_a_text_over_the_budget_runs_alone() -> None:
    batcher = make(max_cost=64)
    batcher.add_many([Text(0, 128), Text(1, 16)], now=1.0)
    assert lengths(batcher.poll(1.0)) == [128]
    assert lengths(batcher.poll(1.0, backlog=True)) == [16]


def test_shorter_texts_join_the_oldest_and_longer_ones_wait_to_lead() -> None:
    batcher = make(max_cost=1024)
    batcher.add_many([Text(0, 32), Text(1, 256), Text(2, 16), Text(3, 32), Text(4, 256)], now=1.0)
    first = batcher.poll(1.0, backlog=True)
    assert [t.n for t in first.items] == [0, 2, 3]  # type: ignore[union-attr]
    second = batcher.poll(1.0, backlog=True)
    assert [t.n for t in second.items] == [1, 4]  # type: ignore[union-attr]


def test_a_wide_batch_takes_the_texts_it_pads_least() -> None:
    # Room for 4 rows of 128: the 112s join before the older 96s, and the 16s (a row
    # mostly padding) not at all: they lead a narrow batch of their own.
    batcher = make(max_cost=512)
    widths = [128, 16, 96, 112, 112, 16, 112]
    batcher.add_many([Text(n, width) for n, width in enumerate(widths)], now=1.0)
    first = batcher.poll(1.0, backlog=True)
    assert [t.n for t in first.items] == [0, 3, 4, 6]  # type: ignore[union-attr]
    second = batcher.poll(1.0, backlog=True)
    assert [t.n for t in second.items] == [1, 5]  # type: ignore[union-attr]
    third = batcher.poll(1.0, backlog=True)
    assert [t.n for t in third.items] == [2]  # type: ignore[union-attr]


def test_a_stream_keeps_its_order_when_one_of_its_items_waits() -> None:
    batcher = make(max_cost=1024)
    batcher.add_many([Text(0, 16), Text(1, 32, "s"), Text(2, 16, "s"), Text(3, 16)], now=1.0)
    first = batcher.poll(1.0, backlog=True)
    # Item 2 is short but may not overtake item 1 of its stream.
    assert [t.n for t in first.items] == [0, 3]  # type: ignore[union-attr]
    second = batcher.poll(1.0, backlog=True)
    assert [t.n for t in second.items] == [1, 2]  # type: ignore[union-attr]


def test_count_still_closes_a_batch() -> None:
    batcher = make(max_batch_size=3, max_cost=10_000)
    batcher.add_many([Text(i, 16) for i in range(4)], now=1.0)
    batch = batcher.poll(1.0)
    assert batch is not None
    assert batch.reason is CloseReason.FULL
    assert len(batch.items) == 3


def test_drain_keeps_the_budget() -> None:
    batcher = make(max_cost=32)
    batcher.add_many([Text(i, 16) for i in range(5)], now=1.0)
    assert [len(b.items) for b in batcher.drain(1.0)] == [2, 2, 1]


def test_a_cost_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="max_cost"):
        Batcher(4, 0.01, cost_of=lambda text: 1)


@given(
    texts=st.lists(
        st.tuples(st.sampled_from([16, 32, 64, 128]), st.sampled_from([None, "a", "b"])),
        max_size=40,
    ),
    max_batch_size=st.integers(min_value=1, max_value=8),
    max_cost=st.integers(min_value=16, max_value=512),
)
def test_every_item_leaves_once_within_budget_and_streams_in_order(
    texts: list[tuple[int, str | None]], max_batch_size: int, max_cost: int
) -> None:
    batcher = make(max_batch_size=max_batch_size, max_cost=max_cost)
    added = [Text(n, length, stream) for n, (length, stream) in enumerate(texts)]
    batcher.add_many(added, now=1.0)
    out: list[Text] = []
    while len(batcher):
        batch = batcher.poll(1.0, backlog=True)
        assert batch is not None
        assert batch.items
        width = max(t.length for t in batch.items)
        assert len(batch.items) <= max_batch_size
        assert len(batch.items) == 1 or len(batch.items) * width <= max_cost
        assert batch.items[0] == min((t for t in added if t not in out), key=lambda t: t.n)
        out.extend(batch.items)
    assert sorted(t.n for t in out) == [t.n for t in added]
    for stream in ("a", "b"):
        order = [t.n for t in out if t.stream == stream]
        assert order == sorted(order)
