"""Exactly-once writes: a transactional producer per request partition, a transaction per publish.

aiokafka implements Kafka's transactions as they were before KIP-447: an offset
commit inside a transaction is not tied to the consumer group's generation, so
nothing stops a worker that lost a partition (a "zombie": paused, evicted, cut off)
from committing work on it after the group gave it to another worker. The fence is
the transactional id instead, one per request partition (``<group>:<topic>:<n>``):

- when a worker is given a partition, it starts that partition's producer first
  (``open``, run by the consumer before it fetches the partition), which bumps the
  id's epoch: the broker aborts whatever transaction the previous owner left open
  and refuses its later writes (``ProducerFenced``); only then does the consumer read
  the committed position and fetch from it;
- every transaction carries one partition's results and dead letters together with
  the partition's next position (``send_offsets_to_transaction``), so either all of
  it is visible to ``read_committed`` readers, position included, or none of it;
- a partition's producer is stopped when the partition is revoked (``close``).

A transaction that fails in any way is abandoned, never repeated by the same
producer: ``publish`` reports the partition ``LOST``, and the caller reads the
partition again from its committed position behind a new producer (whose start
aborts the failed transaction). Results go to Redis before the transactions start,
first answer wins, outside any transaction (``workers.publish.publisher.Publisher.store``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import OffsetAndMetadata

from workers.publish.errors import WriteRefused
from workers.publish.publisher import Publisher
from workers.types import Chain, Committed, PartitionCommit, PositionNotes
from workers.types import TopicPartition as TP

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0
_STOP_TIMEOUT_S = 10.0


def transactional_id(group: str, tp: TP) -> str:
    """The transactional id of request partition ``tp``'s producer in ``group``."""
    return f"{group}:{tp[0]}:{tp[1]}"


class Transactions:
    """The transactional producers of one worker's request partitions
    (the ``TransactionalSink`` of ``workers.types``)."""

    def __init__(
        self,
        publisher: Publisher,
        group: str,
        timeout_ms: int,
        notes: PositionNotes | None = None,
        chain: Chain | None = None,
    ) -> None:
        """``notes`` give the metadata committed with each position (the consumer's);
        ``chain`` runs a pipeline's step on each part first, so a parent's child requests
        are sent in the transaction that commits the parent (``workers.chain``)."""
        self._publisher = publisher
        self._chain = chain
        self._group = group
        self._notes = notes
        self._timeout_ms = timeout_ms
        self._producers: dict[TP, AIOKafkaProducer] = {}
        self._writing: dict[TP, asyncio.Task[Committed]] = {}
        self._opening: dict[TP, asyncio.Task[None]] = {}
        self._failures = 0  # transactions failed in a row, for the backoff

    async def open(self, partitions: Collection[TP]) -> None:
        """Start a producer for each partition (its previous one, if any, is stopped), so
        that the previous owner's open transaction is aborted and its writes refused.

        Retries outages until the broker answers, unless the partition is closed
        meanwhile (revoked: a producer started now would fence its next owner's); raises
        ``PublishConfigError`` when a configuration error (e.g. a refused
        transactional-id ACL) outlasts its grace.
        """
        tasks = {tp: asyncio.create_task(self._open_one(tp)) for tp in partitions}
        self._opening.update(tasks)
        try:
            results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            for tp, task in tasks.items():
                if self._opening.get(tp) is task:
                    del self._opening[tp]
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    async def close(self, partitions: Collection[TP]) -> None:
        """Stop the producers of ``partitions``; a transaction in progress is abandoned
        (the partition's next owner aborts it when it starts its producer)."""
        for tp in partitions:
            for task in (self._writing.get(tp), self._opening.get(tp)):
                if task is not None:
                    task.cancel()
        await asyncio.gather(*(self._stop(self._producers.pop(tp, None)) for tp in partitions))

    async def aclose(self) -> None:
        await self.close(list(self._producers))

    async def publish(self, parts: Sequence[PartitionCommit]) -> tuple[list[Committed], int]:
        """Write every part: results to Redis (first wins), then one transaction per part.

        Returns how each part's transaction ended, and how many results were already in
        Redis (their stored bytes went to the reply topic instead).
        """
        if self._chain is not None:
            for part in parts:
                await self._chain.settle(part.outbox)
        ids = [i for part in parts for i in part.outbox.ids]
        values = [v for part in parts for v in part.outbox.values]
        sent, duplicates = await self._publisher.store(ids, values)
        tasks = []
        start = 0
        for part in parts:
            count = len(part.outbox.ids)
            task = asyncio.create_task(self._write(part, sent[start : start + count]))
            self._writing[part.partition] = task
            tasks.append(task)
            start += count
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for part in parts:
                self._writing.pop(part.partition, None)
        ended = []
        for outcome in outcomes:
            if isinstance(outcome, Committed):
                ended.append(outcome)
            elif isinstance(outcome, asyncio.CancelledError):
                ended.append(Committed.CLOSED)
            else:
                raise outcome
        await self._back_off(ended)
        return ended, duplicates

    async def _write(self, part: PartitionCommit, values: Sequence[bytes]) -> Committed:
        tp = part.partition
        producer = self._producers.get(tp)
        if producer is None:
            return Committed.CLOSED
        try:
            with self._publisher.awaiting_kafka():
                await producer.begin_transaction()
                await self._publisher.send(producer, part.outbox, values)
                note = "" if self._notes is None else self._notes.note(tp, part.position)
                await producer.send_offsets_to_transaction(
                    {TopicPartition(*tp): OffsetAndMetadata(part.position, note)}, self._group
                )
                await producer.commit_transaction()
        except ProducerFenced:
            _read_failure(producer)
            log.warning(
                "the producer of %s[%d] was fenced (the partition has another owner, or the "
                "transaction outlived transaction_timeout_ms); reading it again from its "
                "committed position",
                *tp,
            )
            return Committed.LOST
        except (KafkaError, OSError, AssertionError, WriteRefused) as exc:
            # AssertionError: aiokafka's transaction state machine refuses a step after
            # a fatal error. Whatever failed, this producer is not used again.
            _read_failure(producer)
            if isinstance(exc, KafkaError | OSError | WriteRefused):
                self._publisher.note_failure("kafka", _cause(exc))
            log.warning(
                "transaction on %s[%d] failed (%r); reading the partition again from its "
                "committed position",
                *tp,
                exc,
            )
            return Committed.LOST
        self._publisher.note_success()
        return Committed.YES

    async def _back_off(self, ended: Sequence[Committed]) -> None:
        """After failed transactions, wait (doubling up to a cap) before they are redone."""
        if Committed.LOST not in ended:
            self._failures = 0
            return
        self._failures += 1
        await asyncio.sleep(min(_BACKOFF_MAX_S, _BACKOFF_START_S * 2 ** (self._failures - 1)))

    async def _open_one(self, tp: TP) -> None:
        await self._stop(self._producers.pop(tp, None))
        delay = _BACKOFF_START_S
        while True:
            producer = self._publisher.transactional_producer(
                transactional_id(self._group, tp), self._timeout_ms
            )
            try:
                await producer.start()
            except asyncio.CancelledError:  # closed while starting: it must not stay open
                await self._stop(producer)
                raise
            except (KafkaError, OSError) as exc:
                await self._stop(producer)
                self._publisher.note_failure("kafka", _cause(exc))  # raises past its grace
                log.warning("starting the producer of %s[%d] failed (%r); retrying", *tp, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            self._producers[tp] = producer
            return

    async def _stop(self, producer: AIOKafkaProducer | None) -> None:
        if producer is None:
            return
        try:
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await producer.stop()
        except TimeoutError:
            log.warning("a transactional producer did not stop in %.0f s", _STOP_TIMEOUT_S)
        except KafkaError as exc:
            log.warning("stopping a transactional producer failed: %r", exc)


def _cause(exc: BaseException) -> BaseException:
    """The error behind aiokafka's wrappers: its sender dies with "Unexpected error during
    batch delivery" raised from, e.g., a lost connection, which is an outage to retry
    rather than a refusal to report."""
    while isinstance(exc.__cause__, KafkaError | OSError):
        exc = exc.__cause__
    return exc


def _read_failure(producer: AIOKafkaProducer) -> None:
    """Read the failed transaction's outcome, which aiokafka leaves unread when its sender
    dies: asyncio would log it as an error ("never retrieved") once it is collected."""
    manager = getattr(producer, "_txn_manager", None)
    waiter = None if manager is None else manager.wait_for_transaction_end()
    if isinstance(waiter, asyncio.Future) and waiter.done() and not waiter.cancelled():
        waiter.exception()
