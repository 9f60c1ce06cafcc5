"""Answers released in offset order, per partition, for exactly-once commits.

In exactly-once delivery (``workers.delivery.policies.ExactlyOnce``) one transaction carries
a partition's answers together with its next position, and after a crash the
partition is read again from the last position committed. So a transaction may
only carry answers of records below the position it commits: the answer of a later
record, committed early, would be written a second time when that record is read
and answered again. Answers become ready out of order (a refusal at parse time, an
expired or superseded item, a batch split to isolate a bad item), so `InOrder`
holds each answer until every record before it in its partition is answered too.

It releases whole spans (``workers.offsets``: the records of one fetch), the unit
the offset tracker counts in, oldest first: a partition's released prefix ends at
its first span with a record still unanswered. Pure bookkeeping: no Kafka, no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

from workers.offsets import OffsetTracker, Span
from workers.types import Item, Outcome, Refusal, TopicPartition

__all__ = ["InOrder", "Release"]


class Release(NamedTuple):
    """A partition's answered prefix: what one transaction carries."""

    partition: TopicPartition
    outcomes: list[Outcome]  # the answers of ``spans``, a piece per span and batch
    spans: list[Span]  # oldest first; every record of them is answered
    position: int  # the offset after the last of them: commit this with the answers


class InOrder:
    """Holds answers per span until the spans before them are answered too."""

    def __init__(self, tracker: OffsetTracker[TopicPartition]) -> None:
        self._tracker = tracker
        self._pieces: dict[Span, list[Outcome]] = defaultdict(list)
        self._ready: dict[Span, int] = defaultdict(int)  # records of the span answered
        self._partition: dict[Span, TopicPartition] = {}  # of every span held
        self._touched: set[TopicPartition] = set()  # partitions with answers since release

    def __len__(self) -> int:
        """Answers held."""
        return sum(self._ready.values())

    def add(self, outcomes: Iterable[Outcome]) -> None:
        """Hold the answers of ``outcomes``; those of forgotten (revoked) partitions are dropped."""
        for outcome in outcomes:
            if outcome.answered:
                self._add_answered(outcome)
            if outcome.refused:
                self._add_refused(outcome.refused)

    def release(self) -> list[Release]:
        """Every partition's newly answered prefix, which is then no longer held."""
        releases = []
        for tp in self._touched:
            spans: list[Span] = []
            for span in self._tracker.open_spans(tp):
                if self._ready.get(span, 0) != span.open:
                    break
                spans.append(span)
            if spans:
                outcomes = [piece for span in spans for piece in self._pieces.pop(span)]
                for span in spans:
                    del self._ready[span]
                    del self._partition[span]
                releases.append(Release(tp, outcomes, spans, spans[-1].end))
        self._touched.clear()
        return releases

    def forget(self, tp: TopicPartition) -> None:
        """Drop what is held of ``tp``: its records will be read and answered again."""
        gone = [span for span, where in self._partition.items() if where == tp]
        for span in gone:
            del self._ready[span], self._pieces[span], self._partition[span]
        self._touched.discard(tp)

    def _held_in(self, span: Span, tp: TopicPartition) -> None:
        self._partition[span] = tp
        self._touched.add(tp)

    def _add_answered(self, outcome: Outcome) -> None:
        by_span: dict[Span, tuple[list[Item], list[Any]]] = {}
        for item, output in zip(outcome.answered, outcome.outputs, strict=True):
            span = item.span
            if span.released:
                continue
            piece = by_span.get(span)
            if piece is None:
                piece = by_span[span] = ([], [])
                self._held_in(span, (item.record.topic, item.record.partition))
            piece[0].append(item)
            piece[1].append(output)
        for span, (items, outputs) in by_span.items():
            self._pieces[span].append(Outcome(items, outputs, outcome.timing))
            self._ready[span] += len(items)

    def _add_refused(self, refused: list[Refusal]) -> None:
        by_span: dict[Span, list[Refusal]] = {}
        for refusal in refused:
            span = refusal.span
            if span.released:
                continue
            piece = by_span.get(span)
            if piece is None:
                piece = by_span[span] = []
                self._held_in(span, (refusal.record.topic, refusal.record.partition))
            piece.append(refusal)
        for span, refusals in by_span.items():
            self._pieces[span].append(Outcome(refused=refusals))
            self._ready[span] += len(refusals)
