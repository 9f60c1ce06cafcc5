"""How answers become durable and positions committed: the worker's delivery policy.

The pipeline hands every batch of finished work (``Outcome``) to a `Delivery` and
reads back what was delivered, for its metrics. The two policies
(``WorkerSettings.delivery``) differ in what a publish writes and in who commits:

- `AtLeastOnce` (the default): a publish writes the answers to Redis and the reply
  topic (``workers.publish.publisher``), finishes their spans (``workers.offsets``), and
  ``workers.delivery.commits`` commits positions in the background. After a crash, what was
  answered since the last commit is answered again: Redis keeps the first answer,
  the reply topic gets a second record.
- `ExactlyOnce`: answers are held until every earlier record of their partition is
  answered (``workers.delivery.inorder``); then each partition's answers, dead letters and
  next position are written in one Kafka transaction (``workers.delivery.transactions``), so
  positions are committed by the transactions and ``workers.delivery.commits`` is not used.
  A partition whose transaction fails is read again from its committed position.
  Records skipped after a partition's last answer are committed past by a
  transaction of the position alone once the worker is idle (``ExactlyOnce.flush``).

Both keep the rule of ``workers.offsets``: a position is committed only once every
record below it has its answer written.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

from workers.delivery.commits import Committer
from workers.delivery.inorder import InOrder
from workers.offsets import OffsetTracker
from workers.publish.answers import Answers, Built
from workers.types import (
    Committed,
    Outbox,
    Outcome,
    PartitionCommit,
    RecordSource,
    ResultSink,
    TopicPartition,
    TransactionalSink,
)

log = logging.getLogger(__name__)


class Delivered(NamedTuple):
    """What one `Delivery.deliver` made durable."""

    built: list[Built]  # the answers written, with the spans they finished
    duplicates: int  # answers already in Redis (redelivered requests): left unchanged
    outcomes: Sequence[Outcome]  # the work those answers came from


class Delivery(Protocol):
    """Makes answers durable and commits positions (`AtLeastOnce` or `ExactlyOnce`)."""

    at_once: int
    """How many ``deliver`` calls may be in progress at a time."""

    async def deliver(self, outcomes: Sequence[Outcome]) -> Delivered:
        """Write what ``outcomes`` answered (now, or once it may be written) and finish it."""

    async def flush(self, partitions: Collection[TopicPartition] | None = None) -> None:
        """Commit now what may be committed (of ``partitions`` only, when given)."""

    def skipped(self) -> None:
        """Records were finished without an answer (left to the model's other consumer
        group): commit past them soon."""

    async def release(self, partitions: Collection[TopicPartition]) -> None:
        """``partitions`` go to another worker after their drain: commit what may be."""

    async def close(self) -> None:
        """Stop background work (an abrupt stop loses nothing: it is redelivered)."""


class AtLeastOnce:
    """Write each publish at once; commit positions after it, in the background.

    Publishes overlap: one waits for the broker's acknowledgements while the next
    writes to Redis and queues its records (in order: ``Publisher.publish``), so a
    result is not held back by an earlier batch's acknowledgement."""

    def __init__(
        self,
        answers: Answers,
        sink: ResultSink,
        tracker: OffsetTracker[TopicPartition],
        source: RecordSource,
        at_once: int,
    ) -> None:
        self.at_once = at_once  # publishes in progress at a time
        self._answers = answers
        self._sink = sink
        self._tracker = tracker
        self._committer = Committer(tracker, source)

    async def deliver(self, outcomes: Sequence[Outcome]) -> Delivered:
        built = self._answers.outbox(outcomes)
        report = await self._sink.publish(built.outbox)
        finish = self._tracker.finish
        for span in built.finished:
            finish(span)
        self._committer.request()
        return Delivered([built], report.duplicates, outcomes)

    async def flush(self, partitions: Collection[TopicPartition] | None = None) -> None:
        await self._committer.flush(partitions)

    def skipped(self) -> None:
        self._committer.request()

    async def release(self, partitions: Collection[TopicPartition]) -> None:
        await self._committer.flush(partitions)

    async def close(self) -> None:
        await self._committer.close()


class ExactlyOnce:
    """Write each partition's answered prefix and its position in one transaction."""

    at_once = 1  # a partition's transactions follow one another

    def __init__(
        self,
        answers: Answers,
        transactions: TransactionalSink,
        tracker: OffsetTracker[TopicPartition],
        source: RecordSource,
    ) -> None:
        self._answers = answers
        self._transactions = transactions
        self._tracker = tracker
        self._source = source
        self._held = InOrder(tracker)

    async def deliver(self, outcomes: Sequence[Outcome]) -> Delivered:
        self._held.add(outcomes)
        releases = self._held.release()
        if not releases:
            return Delivered([], 0, ())
        built = [self._answers.outbox(release.outcomes) for release in releases]
        parts = [
            PartitionCommit(release.partition, answers.outbox, release.position)
            for release, answers in zip(releases, built, strict=True)
        ]
        ended, duplicates = await self._transactions.publish(parts)
        delivered: list[Built] = []
        done: list[Outcome] = []
        lost = []
        for release, answers, end in zip(releases, built, ended, strict=True):
            if end is Committed.YES:
                for span in release.spans:
                    self._tracker.finish(span, span.open)
                self._tracker.mark_committed({release.partition: release.position})
                delivered.append(answers)
                done += release.outcomes
            elif end is Committed.LOST:
                lost.append(release.partition)
        if lost:
            await self._read_again(lost)
        return Delivered(delivered, duplicates, done)

    async def flush(self, partitions: Collection[TopicPartition] | None = None) -> None:
        """Commit positions that no transaction of answers will carry: records skipped
        (canary markers, the other group's requests) after a partition's last answer.
        Each partition with nothing in flight whose position moved past its last commit
        gets a transaction of its position alone. Runs when a fetch comes back empty and
        at the end of a drain, so a group that has caught up shows no lag. (A partition
        revoked first is not committed past them: its next owner skips them again.)"""
        parts = [
            PartitionCommit(tp, Outbox(), position)
            for tp, position in self._tracker.committable().items()
            if (partitions is None or tp in partitions) and not self._tracker.in_flight(tp)
        ]
        if not parts:
            return
        ended, _ = await self._transactions.publish(parts)
        lost = []
        for part, end in zip(parts, ended, strict=True):
            if end is Committed.YES:
                self._tracker.mark_committed({part.partition: part.position})
            elif end is Committed.LOST:
                lost.append(part.partition)
        if lost:
            await self._read_again(lost)

    def skipped(self) -> None:
        """Nothing now: the partition's next transaction commits past them, or ``flush``
        when none comes."""

    async def release(self, partitions: Collection[TopicPartition]) -> None:
        for tp in partitions:
            self._held.forget(tp)
        await self._transactions.close(partitions)

    async def close(self) -> None:
        await self._transactions.aclose()

    async def _read_again(self, partitions: list[TopicPartition]) -> None:
        """Drop the work in flight of ``partitions`` and fetch them again from their committed
        positions, behind new producers: the failed transactions are aborted, and nothing
        fetched before can be committed by the new producers."""
        for tp in partitions:
            dropped = self._tracker.in_flight(tp)
            self._tracker.forget(tp)
            self._held.forget(tp)
            log.warning(
                "%s[%d]: %d records in flight dropped; reading from the committed position",
                tp[0],
                tp[1],
                dropped,
            )
        await self._source.restart(partitions)


def delivery_for(
    answers: Answers,
    sink: ResultSink,
    tracker: OffsetTracker[TopicPartition],
    source: RecordSource,
    transactions: TransactionalSink | None,
    publishes_in_flight: int,
) -> Delivery:
    """Exactly once through ``transactions`` when given, else at least once with up to
    ``publishes_in_flight`` publishes in progress."""
    if transactions is None:
        return AtLeastOnce(answers, sink, tracker, source, publishes_in_flight)
    return ExactlyOnce(answers, transactions, tracker, source)
