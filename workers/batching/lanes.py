"""Priority lanes: one model's request topics by priority, and the two choices they need.

A model may read several request topics, highest priority first
(``WorkerSettings.lanes``, e.g. ``high:8`` reads ``conveyor.<model>.requests.high``
before ``conveyor.<model>.requests``). Each lane has a weight. Two choices depend on
the lanes, both pure (no clock, no I/O) and made here:

- **which lane the next batch comes from** (`LaneBatcher`, one FIFO ``Batcher`` per
  lane, so a batch holds one lane's items): the highest lane with a batch due, except
  that a lane passed over `LaneScheduler.max_skips` times in a row while it had a
  batch due goes next. With ``W`` the sum of the weights, a lane of weight ``w`` with
  work waiting gets at least one batch in ``⌈W/w⌉`` (the default lane of ``high:8``
  one in 9); with more than two lanes, lanes overdue at the same moment go one after
  another, the one kept waiting longest past its bound first (ties: highest first), so
  none waits more than ``len(weights) - 2`` batches past its bound. A lane alone with
  work waits for nobody: while other lanes have work, its batch closes at once instead
  of waiting ``max_delay`` for more.
- **which lanes to stop fetching** (`paused_lanes`): the in-flight budget is shared by
  weight. Once the worker holds its budget, a lane that holds its share of it is
  paused; a lane below its share keeps fetching. So a backlog in a low lane never
  keeps high-lane requests in the topic, and in flight stays below twice the budget.

Together: a high-lane request waits for at most the batch running on the model and
the one queued behind it (``workers.model.inference.SLOTS``), plus one low-lane batch when
the low lane is owed its turn, never for a low lane's backlog.

``LaneTopics`` applies both to a worker's request topics. The lanes themselves
(``LaneSpec``: a name and a weight) are read from the ``--lanes`` setting here too
(``parse_lanes``, ``checked_lanes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from schemas import DEFAULT_LANE, ModelTopics
from workers.batching.batcher import Batch, Batcher, CloseReason
from workers.types import Outcome

__all__ = ["LaneBatcher", "LaneScheduler", "paused_lanes"]

T = TypeVar("T")


class LaneScheduler:
    """Which lane's batch runs next: priority order, with a bounded wait for every lane."""

    def __init__(self, weights: Sequence[int]) -> None:
        if not weights or min(weights) < 1:
            raise ValueError(f"every lane needs a weight of at least 1, got {list(weights)}")
        total = sum(weights)
        self.max_skips = [math.ceil(total / weight) - 1 for weight in weights]
        """Per lane: batches of other lanes that may run in a row while it has one due."""
        self._skipped = [0] * len(weights)

    def pick(self, due: Sequence[bool]) -> int | None:
        """The lane to take a batch from, given which lanes have one due; None if none."""
        chosen: int | None = None
        most = -1  # owed its turn: skipped at least max_skips times, so over >= 0
        for lane, ready in enumerate(due):
            # Of the lanes owed, the one kept waiting longest past its bound.
            over = self._skipped[lane] - self.max_skips[lane]
            if ready and over > most:
                chosen, most = lane, over
        if chosen is None:
            chosen = next((lane for lane, ready in enumerate(due) if ready), None)
            if chosen is None:
                return None
        skipped = self._skipped
        for lane, ready in enumerate(due):
            # A lane with nothing due is not kept waiting: its count starts again.
            skipped[lane] = skipped[lane] + 1 if ready and lane != chosen else 0
        return chosen


class LaneBatcher(Generic[T]):
    """A ``Batcher`` per lane (lane 0 the highest) behind the ``Batcher`` interface.

    Expired items of every lane leave at each `poll`, whichever lane's batch runs.
    With one lane it is that lane's ``Batcher``, at the cost of one call.
    """

    def __init__(
        self,
        weights: Sequence[int],
        max_batch_size: int,
        max_delay: float,
        deadline_of: Callable[[T], float | None] | None = None,
        **costs: Any,
    ) -> None:
        """``costs``: ``Batcher``'s ``cost_of``, ``max_cost`` and ``group_of``, per lane."""
        self._scheduler = LaneScheduler(weights)
        self._lanes = [Batcher(max_batch_size, max_delay, deadline_of, **costs) for _ in weights]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes)

    def add_many(self, lane: int, items: Iterable[T], now: float) -> None:
        """Queue ``items`` of ``lane`` in order, all arrived at ``now``."""
        self._lanes[lane].add_many(items, now)

    def poll(
        self, now: float, backlog: bool = False, full_only: bool = False, idle: bool = False
    ) -> Batch[T] | None:
        """A batch of one lane if one is due (`LaneScheduler` chooses), else the expired
        items alone (reason ``deadline``), else None. Expired items of every lane go in
        the batch's ``expired``. ``full_only``: only a full batch is due; ``idle``: nothing
        else is on its way (``Batcher.poll``)."""
        lanes = self._lanes
        if len(lanes) == 1:
            return lanes[0].poll(now, backlog, full_only, idle)
        expired = [batch for lane in lanes if (batch := lane.take_expired(now)) is not None]
        # While other lanes have work, a lane's batch closes at once: waiting for it to
        # fill would hold the model for one lane while another is ready.
        contended = backlog or sum(1 for lane in lanes if len(lane)) > 1
        due = [lane.due(now, contended, full_only, idle) is not None for lane in lanes]
        chosen = self._scheduler.pick(due)
        batch = None if chosen is None else lanes[chosen].poll(now, contended, full_only, idle)
        if not expired:
            return batch
        gone = [item for part in expired for item in part.expired]
        if batch is None:
            return Batch([], gone, CloseReason.DEADLINE)
        return Batch(batch.items, gone + batch.expired, batch.reason)

    def withdraw(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Remove and return the items of every lane for which ``unwanted`` holds."""
        return [item for lane in self._lanes for item in lane.withdraw(unwanted)]

    def next_deadline(self) -> float | None:
        """The earliest time any lane's `poll` has something without new input."""
        deadlines = [d for lane in self._lanes if (d := lane.next_deadline()) is not None]
        return min(deadlines, default=None)

    def drain(self, now: float) -> list[Batch[T]]:
        """Everything left, lane by lane from the highest (``Batcher.drain``)."""
        return [batch for lane in self._lanes for batch in lane.drain(now)]


def paused_lanes(in_flight: Sequence[int], cap: int, weights: Sequence[int]) -> list[bool]:
    """Per lane, whether to stop fetching it, from its records in flight.

    Below ``cap`` in total nothing pauses. At or above it, a lane pauses once it holds
    its share of ``cap`` (``cap * weight / sum of weights``): one lane alone pauses at
    ``cap``, and a lane below its share goes on fetching whatever the others hold.
    """
    if sum(in_flight) < cap:
        return [False] * len(in_flight)
    total = sum(weights)
    return [count * total >= cap * weight for count, weight in zip(in_flight, weights, strict=True)]


class LaneTopics:
    """A worker's request topics as lanes, highest first: which lane a topic is, which
    topics to pause for the load in flight, and answers' latency by lane."""

    def __init__(self, lanes: Sequence[LaneSpec], topics: ModelTopics) -> None:
        self.names = [lane.name for lane in lanes]
        self.weights = [lane.weight for lane in lanes]
        self.topics = [topics.lane(lane.name) for lane in lanes]
        self.index = {topic: n for n, topic in enumerate(self.topics)}  # lane by topic
        self.several = len(self.topics) > 1
        self._every = frozenset(self.topics)

    def paused(
        self,
        in_flight: int,
        cap: int,
        by_partition: Callable[[], Iterable[tuple[tuple[str, int], int]]],
    ) -> frozenset[str]:
        """The topics to stop fetching: all at ``cap``, or lanes at their share of it
        (``paused_lanes``); ``by_partition`` gives the records in flight per partition."""
        if not self.several:
            return self._every if in_flight >= cap else _NOTHING
        per_lane = [0] * len(self.topics)
        for (topic, _), count in by_partition():
            per_lane[self.index[topic]] += count
        paused = paused_lanes(per_lane, cap, self.weights)
        return frozenset(topic for topic, p in zip(self.topics, paused, strict=True) if p)

    def end_to_end(self, outcomes: Iterable[Outcome], durable_ms: float) -> dict[str, list[float]]:
        """Seconds from each answered request's record timestamp to ``durable_ms``, by lane."""
        by_lane: dict[str, list[float]] = {}
        for outcome in outcomes:
            records = [item.record for item in outcome.answered]
            records += [refusal.record for refusal in outcome.refused if refusal.request_id]
            for record in records:
                lane = self.names[self.index[record.topic]]
                by_lane.setdefault(lane, []).append((durable_ms - record.timestamp) / 1000.0)
        return by_lane


_NOTHING: frozenset[str] = frozenset()


# -- the lanes a worker serves: WorkerSettings.lanes -----------------------------------

_MAX_LANE_WEIGHT = 1000


class LaneSpec(NamedTuple):
    """One priority lane of ``WorkerSettings.lanes``."""

    name: str  # DEFAULT_LANE for the model's plain request topic
    weight: int  # its share of batches and of records in flight while lanes compete


def parse_lanes(value: Any) -> Any:
    """``"high:8,default,bulk"`` (a flag or variable) → ``(("high", 8), ("default", 1), …)``."""
    if not isinstance(value, str):
        return value
    lanes = []
    for part in value.split(","):
        if not part.strip():
            continue
        name, _, weight = part.strip().partition(":")
        if weight and not weight.isdigit():
            raise ValueError(f"lane {part.strip()!r}: the weight after ':' must be a number")
        lanes.append((name, int(weight) if weight else 1))
    return tuple(lanes)


def checked_lanes(lanes: tuple[LaneSpec, ...]) -> tuple[LaneSpec, ...]:
    """``lanes`` with the default lane added last when missing; raises ``ValueError`` for
    a name given twice or a weight out of range."""
    names = [lane.name for lane in lanes]
    if len(set(names)) != len(names):
        raise ValueError(f"lane names must be unique, got {', '.join(names)}")
    for lane in lanes:
        if not 1 <= lane.weight <= _MAX_LANE_WEIGHT:
            raise ValueError(f"lane {lane.name}: weight must be 1 to {_MAX_LANE_WEIGHT}")
    if lanes and DEFAULT_LANE not in names:
        lanes = (*lanes, LaneSpec(DEFAULT_LANE, 1))
    return lanes
