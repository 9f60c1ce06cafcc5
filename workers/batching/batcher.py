"""When to close a micro-batch: the pure core, with no asyncio, Kafka or torch.

Items wait in one FIFO queue. `Batcher.poll` closes a batch from the front of the
queue when it is full, when its oldest item has waited ``max_delay`` seconds, or
at once when the caller reports a backlog (more records already fetched or being
decoded: waiting on the timer would only add latency) or that the source is idle
(nothing else is on its way: every partition fetched to its end, so the timer would
only delay a lone request by ``max_delay`` for company that is not coming). Items whose deadline has
passed are taken out of the queue and handed back separately, so they are
answered ``expired`` without ever reaching the model.

The caller owns the clock: every method that needs the time takes ``now``, in
monotonic seconds, so tests drive the batcher with plain numbers and never sleep.
Order is always kept (frames of one stream must reach the model in order), both
in batches and in `withdraw`, which takes out items a caller no longer wants run
(frames superseded by newer ones, ``workers.batching.freshest``), keeping the others' order;
``workers.batching.lanes`` builds priority lanes from one batcher per lane.

A batch may also have a cost (text models: ``cost_of(item)`` is the item's padded
length, and a batch costs its rows times its widest item, the tokens a forward
computes, as Text Embeddings Inference's queue counts them). With ``max_cost`` a
batch closes (``budget``) before one more row would pass it; an item that passes it
alone runs alone. Items of similar cost go together: the oldest item always leads
the next batch and sets its width, and items behind it that are no wider and at
least half as wide join it, within the first ``WINDOW_BATCHES`` batches' worth of the
queue, the widest first (a batch of width 128 takes the 112s first and never the 16s,
which would be mostly padding in it: they lead a narrow batch of their own soon); a
wider one waits to lead a batch of its own (it is the oldest soon enough, so it waits
no longer than the timer), and so does a narrower one.
``group_of(item)`` (a video stream's id) keeps a group's order: once one of its items
waits, the group's later items wait behind it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

__all__ = ["Batch", "Batcher", "CloseReason"]

T = TypeVar("T")

WINDOW_BATCHES = 4
"""How far behind the oldest item a costed batch looks for items to join it, in batches
of ``max_batch_size``: a bounded pass per batch, whatever the queue holds."""


class CloseReason(StrEnum):
    """Why a batch was closed (a metrics label, so the values are stable)."""

    FULL = "full"  # max_batch_size items were waiting
    TIMEOUT = "timeout"  # the oldest item waited max_delay
    BACKLOG = "backlog"  # more work was already waiting, so the timer was skipped
    DRAIN = "drain"  # shutdown or partition revocation: everything left goes out
    DEADLINE = "deadline"  # only expired items to hand back; no batch was due
    BUDGET = "budget"  # one more row would have passed max_cost (rows × the widest item)
    IDLE = "idle"  # nothing else was on its way (the source caught up): no timer to wait for


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """One closed batch. ``items`` go to the model; ``expired`` must not."""

    items: list[T]  # at most max_batch_size, in arrival order; may be empty
    expired: list[T]  # items whose deadline had passed when it closed, in arrival order
    reason: CloseReason


@dataclass(frozen=True, slots=True)
class _Entry(Generic[T]):
    item: T
    arrived: float
    deadline: float | None
    seq: int  # arrival sequence number: the queue is always sorted by it
    cost: int  # per row, e.g. a text's padded length; 1 without cost_of


class Batcher(Generic[T]):
    """Forms batches of at most ``max_batch_size`` items from a FIFO queue.

    ``deadline_of(item)`` gives an item's absolute deadline in the caller's clock
    (or None for none). An item is expired once ``now >= deadline``; `poll` and
    `drain` remove every expired item in the queue, wherever it stands, and return
    it in `Batch.expired`, keeping the other items' order.

    Typical loop: ``add`` what arrived; ``poll(now, backlog)``; when it returns
    None, sleep until `next_deadline` or until new items arrive.

    ``cost_of``, ``max_cost`` and ``group_of``: batches by cost (see the module doc);
    without ``cost_of``, batches are the front of the queue, by count alone.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_delay: float,
        deadline_of: Callable[[T], float | None] | None = None,
        *,
        cost_of: Callable[[T], int] | None = None,
        max_cost: int | None = None,
        group_of: Callable[[T], object] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_delay < 0:
            raise ValueError(f"max_delay must be 0 or more seconds, got {max_delay}")
        if cost_of is not None and (max_cost is None or max_cost < 1):
            raise ValueError(f"batches with a cost need a max_cost of at least 1, got {max_cost}")
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_cost = max_cost
        self._cost_of = cost_of
        self._group_of = group_of
        self._deadline_of = deadline_of
        self._queue: deque[_Entry[T]] = deque()
        # Min-heap of (deadline, seq) so finding whether anything expired is O(1).
        # Entries of items that already left in a batch are dropped lazily: they are
        # exactly those with a seq below the queue's front (batches leave from the front).
        self._deadlines: list[tuple[float, int]] = []
        self._seq = 0

    def __len__(self) -> int:
        """Items waiting in the queue."""
        return len(self._queue)

    def add(self, item: T, now: float) -> None:
        """Queue ``item``, which arrived at ``now``."""
        deadline = self._deadline_of(item) if self._deadline_of is not None else None
        cost = self._cost_of(item) if self._cost_of is not None else 1
        entry = _Entry(item, now, deadline, self._seq, cost)
        self._seq += 1
        self._queue.append(entry)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, entry.seq))

    def add_many(self, items: Iterable[T], now: float) -> None:
        """Queue ``items`` in order, all arrived at ``now``."""
        for item in items:
            self.add(item, now)

    def poll(
        self, now: float, backlog: bool = False, full_only: bool = False, idle: bool = False
    ) -> Batch[T] | None:
        """Close a batch if one is due at ``now``, else return None.

        A batch is due when the queue holds ``max_batch_size`` items (``full``), when
        its oldest item arrived ``max_delay`` or more seconds ago (``timeout``), when
        ``backlog`` is true and anything is queued (``backlog``), or when ``idle`` is
        true (nothing else is on its way) and anything is queued (``idle``); with
        ``full_only``, only when it is full. Expired items are removed first; if some
        expired but no batch is due, the result is a Batch with no items, only
        ``expired``, and reason ``deadline``.
        """
        expired = self._take_expired(now)
        reason = self._due(now, backlog, full_only, idle)
        if reason is None:
            if not expired:
                return None
            return _batch([], expired, CloseReason.DEADLINE)
        return _batch(self._take(), expired, reason)

    def due(
        self, now: float, backlog: bool = False, full_only: bool = False, idle: bool = False
    ) -> CloseReason | None:
        """Why `poll` would close a batch of items at ``now``, or None (expired items aside)."""
        return self._due(now, backlog, full_only, idle)

    def take_expired(self, now: float) -> Batch[T] | None:
        """Remove the expired items alone: a Batch with no items, reason ``deadline``, or None."""
        expired = self._take_expired(now)
        return _batch([], expired, CloseReason.DEADLINE) if expired else None

    def withdraw(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Remove and return every queued item for which ``unwanted(item)`` holds, in order;
        the others keep their order and arrival times. One pass over the queue."""
        taken: list[T] = []
        kept: deque[_Entry[T]] = deque()
        for entry in self._queue:
            if unwanted(entry.item):
                taken.append(entry.item)
            else:
                kept.append(entry)
        if taken:
            self._queue = kept
            self._deadlines = [(e.deadline, e.seq) for e in kept if e.deadline is not None]
            heapq.heapify(self._deadlines)
        return taken

    def next_deadline(self) -> float | None:
        """When `poll` will next have something to return without new input: the
        oldest item's timeout or the earliest item deadline, whichever comes first.
        ``poll(t)`` for any ``t >= next_deadline()`` returns a Batch. None when the
        queue is empty. A value at or before now means poll now.
        """
        if not self._queue:
            return None
        due = self._queue[0].arrived + self.max_delay
        self._drop_departed_deadlines()
        if self._deadlines:
            due = min(due, self._deadlines[0][0])
        return due

    def drain(self, now: float) -> list[Batch[T]]:
        """Close everything left, for shutdown: batches of at most ``max_batch_size``
        items, reason ``drain``. Expired items go in the first batch's ``expired``
        (a batch with no items when only expired ones were left). Empty queue: [].
        """
        expired = self._take_expired(now)
        batches: list[Batch[T]] = []
        while self._queue or (expired and not batches):
            taken = self._take()
            batches.append(_batch(taken, [] if batches else expired, CloseReason.DRAIN))
        self._deadlines.clear()
        return batches

    def _take(self) -> list[_Entry[T]]:
        """Remove the next batch's entries from the queue (an empty queue: none)."""
        if self._cost_of is None:
            size = min(self.max_batch_size, len(self._queue))
            return [self._queue.popleft() for _ in range(size)]
        chosen, _ = self._select()
        queue = self._queue
        window = [queue.popleft() for _ in range(min(len(queue), self._window()))]
        taken: list[_Entry[T]] = []
        kept: list[_Entry[T]] = []
        for position, entry in enumerate(window):
            (taken if position in chosen else kept).append(entry)
        queue.extendleft(reversed(kept))
        return taken

    def _window(self) -> int:
        return WINDOW_BATCHES * self.max_batch_size

    def _select(self) -> tuple[set[int], CloseReason | None]:
        """Positions in the queue of the next costed batch (module doc), and ``FULL`` or
        ``BUDGET`` when it cannot grow, else None."""
        queue = self._queue
        if not queue:
            return set(), None
        assert self.max_cost is not None
        width = queue[0].cost
        rows = min(self.max_batch_size, max(1, self.max_cost // width))
        chosen = {0}
        for position in self._joiners(width):
            if len(chosen) >= rows:
                break
            chosen.add(position)
        if len(chosen) >= self.max_batch_size:
            return chosen, CloseReason.FULL
        if (len(chosen) + 1) * width > self.max_cost:
            return chosen, CloseReason.BUDGET
        return chosen, None

    def _joiners(self, width: int) -> list[int]:
        """Positions behind the oldest, within the window, that may join a batch of
        ``width`` (no wider, at least half as wide: a row at most half padding), best
        first: a stream's items in order (a later one never before an
        earlier one that waits), then the others widest first, oldest first among
        equals, so that a wide batch takes the texts it pads least and short ones
        wait to lead a narrow batch of their own (they lead soon, as the oldest)."""
        queue, group_of = self._queue, self._group_of
        streams: list[int] = []
        others: list[int] = []
        waiting: set[object] = set()  # groups with an item left behind
        for position in range(1, min(len(queue), self._window())):
            entry = queue[position]
            group = group_of(entry.item) if group_of is not None else None
            if group is not None and group in waiting:
                continue
            if width <= 2 * entry.cost and entry.cost <= width:
                (others if group is None else streams).append(position)
            elif group is not None:
                waiting.add(group)
        others.sort(key=lambda position: -queue[position].cost)
        return streams + others

    def _due(self, now: float, backlog: bool, full_only: bool, idle: bool) -> CloseReason | None:
        if not self._queue:
            return None
        if self._cost_of is not None:
            _, full = self._select()
            if full is not None:
                return full
        elif len(self._queue) >= self.max_batch_size:
            return CloseReason.FULL
        if full_only:
            return None
        # Compare against arrived + max_delay, the same sum next_deadline returns, so
        # polling at exactly that time is never off by a float rounding.
        if now >= self._queue[0].arrived + self.max_delay:
            return CloseReason.TIMEOUT
        if backlog:
            return CloseReason.BACKLOG
        if idle:
            return CloseReason.IDLE
        return None

    def _take_expired(self, now: float) -> list[_Entry[T]]:
        """Remove and return every queued entry with ``deadline <= now``, in order.

        O(1) when nothing expired; otherwise one pass over the queue, which also
        rebuilds the deadline heap without stale entries.
        """
        self._drop_departed_deadlines()
        if not self._deadlines or self._deadlines[0][0] > now:
            return []
        expired: list[_Entry[T]] = []
        kept: deque[_Entry[T]] = deque()
        for entry in self._queue:
            if entry.deadline is not None and entry.deadline <= now:
                expired.append(entry)
            else:
                kept.append(entry)
        self._queue = kept
        self._deadlines = [(e.deadline, e.seq) for e in kept if e.deadline is not None]
        heapq.heapify(self._deadlines)
        return expired

    def _drop_departed_deadlines(self) -> None:
        """Pop heap entries of items that already left the queue in a batch."""
        front = self._queue[0].seq if self._queue else self._seq
        while self._deadlines and self._deadlines[0][1] < front:
            heapq.heappop(self._deadlines)


def _batch(taken: list[_Entry[T]], expired: list[_Entry[T]], reason: CloseReason) -> Batch[T]:
    return Batch([e.item for e in taken], [e.item for e in expired], reason)
