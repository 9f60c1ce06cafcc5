"""The worker's Kafka side: fetch records, pause for backpressure, commit what is finished.

Offsets follow one rule, kept here and nowhere else: a partition's committed
position only moves past a record once that record's result is durable (written
to Redis and acknowledged on the reply topic) — see ``finish`` and
``commit_finished``. A partition revoked in a rebalance is drained and committed
before it is released (``_Rebalance.on_partitions_revoked``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from producers.security import kafka_connect_failed, kafka_options
from workers.offsets import OffsetTracker
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

Record = Any  # aiokafka.structs.ConsumerRecord[bytes, bytes]; aiokafka ships no type hints


class Consumer:
    """A consumer-group member on one model's request topic, with manual commits."""

    def __init__(self, settings: WorkerSettings, topic: str, group: str) -> None:
        self._topic = topic
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._next_offset: dict[TopicPartition, int] = {}  # per partition, after the last fetched
        self._progress = asyncio.Condition()
        self._drain_timeout_s = settings.max_drain_ms / 1000.0
        self._settings = settings
        self._kafka = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=group,
            client_id=settings.worker_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # requests sent before any worker started still count
            session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=max(1000, settings.session_timeout_ms // 3),
            max_poll_interval_ms=settings.max_poll_interval_ms,
            rebalance_timeout_ms=settings.rebalance_timeout_ms,
            group_instance_id=settings.group_instance_id,
            max_partition_fetch_bytes=max(1 << 20, settings.limits.max_payload_bytes + 65536),
            fetch_max_bytes=max(50 << 20, settings.limits.max_payload_bytes + 65536),
            **kafka_options(settings),
        )
        self.paused = False

    async def start(self) -> None:
        """Join the group; raises ``ConnectFailed`` naming the cause if Kafka refuses us."""
        self._kafka.subscribe([self._topic], listener=_Rebalance(self))
        try:
            await self._kafka.start()
        except KafkaError as exc:
            await self._kafka.stop()
            raise await kafka_connect_failed(
                self._settings.kafka_bootstrap, self._settings, exc
            ) from None

    async def stop(self) -> None:
        """Commit what is finished and leave the group."""
        try:
            await self.commit_finished()
        finally:
            await self._kafka.stop()

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def fetch(self, timeout_ms: int, max_records: int) -> list[Record]:
        """Fetch the next records (tracked as in flight from here on)."""
        batches = await self._kafka.getmany(timeout_ms=timeout_ms, max_records=max_records)
        records: list[Record] = []
        for tp, recs in batches.items():
            for rec in recs:
                self._tracker.track(tp, rec.offset)
            if recs:
                self._next_offset[tp] = recs[-1].offset + 1
            records.extend(recs)
        return records

    def in_flight(self) -> int:
        return self._tracker.in_flight()

    def assigned(self) -> bool:
        """Whether the group gave this worker at least one partition (readiness)."""
        return bool(self._kafka.assignment())

    def lag(self) -> dict[tuple[str, int], int]:
        """Per assigned partition, records not yet answered: not fetched, plus in flight.

        Partitions not fetched from since their assignment are left out: their
        position is unknown without a request, and a caught-up one adds 0 anyway.
        """
        lag: dict[tuple[str, int], int] = {}
        for tp in self._kafka.assignment():
            end, fetched = self._kafka.highwater(tp), self._next_offset.get(tp)
            if end is not None and fetched is not None:
                lag[(tp.topic, tp.partition)] = max(0, end - fetched) + self._tracker.in_flight(tp)
        return lag

    def set_paused(self, paused: bool) -> None:
        """Pause or resume fetching from every assigned partition (backpressure)."""
        if paused == self.paused:
            return
        assigned = list(self._kafka.assignment())
        if paused:
            self._kafka.pause(*assigned)
        else:
            self._kafka.resume(*self._kafka.paused())
        self.paused = paused

    async def finish(self, done: Sequence[tuple[TopicPartition, int]]) -> None:
        """Mark records whose results are durable; wakes anyone draining a partition."""
        for tp, offset in done:
            self._tracker.done(tp, offset)
        async with self._progress:
            self._progress.notify_all()

    async def commit_finished(self) -> None:
        """Commit, per partition, the position below which every result is durable."""
        positions = self._tracker.committable()
        assigned = self._kafka.assignment()
        positions = {tp: pos for tp, pos in positions.items() if tp in assigned}
        if not positions:
            return
        try:
            await self._kafka.commit(positions)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on: these partitions belong to someone else now, who
            # starts from the last commit; results are idempotent by request id.
            log.warning("commit of %s failed after a rebalance: %s", positions, exc)
        except KafkaError as exc:
            log.warning("commit failed, will retry with the next batch: %s", exc)
            return
        self._tracker.mark_committed(positions)

    async def drain(self, partitions: set[TopicPartition]) -> None:
        """Wait until every fetched record of these partitions is answered, then commit."""

        def drained() -> bool:
            return all(self._tracker.in_flight(tp) == 0 for tp in partitions)

        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(drained), self._drain_timeout_s)
            except TimeoutError:
                log.error(
                    "partitions %s not drained in %.0f s; releasing them uncommitted "
                    "(their records will be redelivered)",
                    partitions,
                    self._drain_timeout_s,
                )
        await self.commit_finished()
        for tp in partitions:
            self._tracker.forget(tp)
            self._next_offset.pop(tp, None)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if revoked:
            log.info("partitions revoked: %s; draining them", _names(revoked))
            await self._consumer.drain(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("partitions assigned: %s", _names(assigned))
        if self._consumer.paused:
            # New partitions start paused too while backpressure holds.
            self._consumer._kafka.pause(*assigned)


def _names(tps: set[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)) or "none"
