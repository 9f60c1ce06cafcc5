"""The worker's Kafka side: a consumer-group member that fetches, pauses and commits.

``Consumer`` is the ``RecordSource`` of the pipeline (``workers.types``): it hands
out records per partition of its request topics (one per priority lane), pauses
topics for backpressure, commits the positions it is given, and before the group
takes partitions away it waits for the pipeline to drain and commit them
(``on_revoke``). Which positions are safe to commit is the pipeline's business
(``workers.offsets``), not this adapter's.

New partitions are held paused until they are taken over: the assignment handler
runs first (``on_assign``; exactly-once delivery starts its transactional producers
there), then fetching starts at their committed positions as read *after* it (an
offset another worker committed in a transaction that the handler's producers
aborted or waited for is never missed), and the metadata committed with each
position is handed to the position notes (``workers.intake.canary.Split``: the
canary share there), which also give the metadata of every commit. A partition
without a committed position starts at its beginning; a shadow's at its end (it
mirrors requests from when it starts); a canary's is refused (``conveyor canary``
places the canary group at its first markers). ``restart`` runs the same steps
again for partitions whose work in flight was dropped.

Fetch responses are read into memory with one copy per frame (``workers.kafka.fetch_buffers``).
No record can stop it: fetch responses are read with ``workers.kafka.records``
(a record aiokafka's parser refuses is read leniently and refused by the worker),
and any other error of a fetch is logged, counted and retried, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence, Set

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    GroupAuthorizationFailedError,
    IllegalStateError,
    KafkaError,
    TopicAuthorizationFailedError,
)

from common.security import kafka_connect_failed, kafka_options
from workers.config.worker import WorkerSettings
from workers.kafka import fetch_buffers
from workers.kafka import records as kafka_records
from workers.observe.metrics import Metrics
from workers.types import Assigned, ConfigError, PositionNotes, Record, Revoked
from workers.types import TopicPartition as TP

log = logging.getLogger(__name__)

_FETCH_BACKOFF_MAX_S = 5.0
_STOP_TIMEOUT_S = 5.0  # workers.app.CLOSE_S leaves room for this and the producer's
_FORBIDDEN = (TopicAuthorizationFailedError, GroupAuthorizationFailedError)


class FetchConfigError(ConfigError):
    """Kafka refuses this worker's reads, and kept refusing past the grace period."""


class TakeOverError(ConfigError):
    """New partitions could not be taken over (assignment handler, committed positions):
    fetching them from anywhere else could break exactly-once delivery, so the worker
    stops and its partitions go to another."""


class Consumer:
    """A consumer-group member on one model's request topics, with manual commits."""

    def __init__(
        self,
        settings: WorkerSettings,
        topics: str | Sequence[str],
        group: str,
        metrics: Metrics | None = None,
        notes: PositionNotes | None = None,
    ) -> None:
        """``notes`` receive the metadata committed with each position taken over, and give
        that of every commit (none: commits carry no metadata)."""
        kafka_records.install()
        if settings.fetch_buffers:
            fetch_buffers.install()
        # Soft limits: Kafka returns a larger first batch whole, so any record fits.
        largest = settings.limits.max_payload_bytes + 65536
        partition_bytes, fetch_bytes = (
            (fetch_buffers.MAX_FETCH_BYTES, fetch_buffers.MAX_FETCH_BYTES)
            if settings.fetch_buffers
            else (max(1 << 20, largest), max(50 << 20, largest))  # as before fetch buffers
        )
        self._metrics = metrics
        self._topics = [topics] if isinstance(topics, str) else list(topics)
        self._group = group
        self._settings = settings
        self._revoked: Revoked | None = None
        self._assigned: Assigned | None = None
        self._notes = notes
        self._assign_error: BaseException | None = None  # the handler's, raised by fetch
        self._next_offset: dict[TP, int] = {}  # per partition, after the last record fetched
        self._kafka = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=group,
            client_id=settings.worker_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # requests sent before any worker started still count
            # Requests written in a transaction count once it commits, never if it aborts.
            isolation_level="read_committed",
            session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=max(1000, settings.session_timeout_ms // 3),
            max_poll_interval_ms=settings.max_poll_interval_ms,
            rebalance_timeout_ms=settings.rebalance_timeout_ms,
            group_instance_id=settings.group_instance_id,
            max_partition_fetch_bytes=partition_bytes,
            fetch_max_bytes=fetch_bytes,
            **kafka_options(settings),
        )
        self._paused_topics: frozenset[str] = frozenset()  # backpressure
        self._held: set[TopicPartition] = set()  # waiting for the assignment handler
        self._pauses_stale = False  # assignment or holds changed since pauses were applied
        self._failures = 0  # fetches failed in a row
        self.config_problem: str | None = None
        """Why Kafka refuses this worker's reads right now, if it does."""
        self._failing_since: float | None = None

    async def start(self) -> None:
        """Join the group; raises ``ConnectFailed`` naming the cause if Kafka refuses us."""
        self._kafka.subscribe(self._topics, listener=_Rebalance(self))
        try:
            await self._kafka.start()
        except KafkaError as exc:
            await self._kafka.stop()
            if isinstance(exc, _FORBIDDEN):  # connected, and refused: an ACL to grant
                raise FetchConfigError(self._refusal(exc)) from None
            raise await kafka_connect_failed(
                self._settings.kafka_bootstrap, self._settings, exc
            ) from None

    async def stop(self) -> None:
        """Leave the group (with static membership, keep the place for a restart), or give up
        after 5 s: with the broker down, aiokafka would retry without end."""
        try:
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await self._kafka.stop()
        except TimeoutError:
            log.warning("the consumer did not leave its group in %.0f s", _STOP_TIMEOUT_S)

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def on_revoke(self, handler: Revoked) -> None:
        self._revoked = handler

    def on_assign(self, handler: Assigned) -> None:
        """Call ``handler`` with new partitions before fetching them (see the module doc).

        A ``ConfigError`` it raises ends the worker: the next ``fetch`` raises it.
        """
        self._assigned = handler

    async def restart(self, partitions: Collection[TP]) -> None:
        """Hold ``partitions``, run the assignment handler for them, then fetch them from
        their committed positions; records fetched past those are fetched again."""
        await self._take_over({TopicPartition(*tp) for tp in partitions})

    async def fetch(self, timeout_ms: int, max_records: int) -> Mapping[TP, Sequence[Record]]:
        """The next records per partition; after an error, none (it is retried next time)."""
        if self._assign_error is not None:
            raise self._assign_error
        try:
            batches: dict[TP, list[Record]] = await self._kafka.getmany(
                timeout_ms=timeout_ms, max_records=max_records
            )
        except Exception as exc:  # whatever a fetch raises, the fetch loop must go on
            await self._fetch_failed(exc)
            return {}
        self._failing_since = self.config_problem = None
        self._failures = 0
        for tp, records in batches.items():
            if records:
                self._next_offset[tp] = records[-1].offset + 1
        return batches

    async def _fetch_failed(self, exc: Exception) -> None:
        self._failures += 1
        if self._metrics is not None:
            self._metrics.fetch_error()
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        failing_for = now - self._failing_since
        if isinstance(exc, _FORBIDDEN):
            if self.config_problem is None:  # one line when it starts, not one per retry
                log.error("%s; the worker is unready until it is fixed", self._refusal(exc))
            self.config_problem = self._refusal(exc)
            if failing_for >= self._settings.permanent_error_grace_s:
                raise FetchConfigError(
                    f"{self.config_problem} (still refused after {failing_for:.0f} s)"
                ) from exc
        else:
            log.error("fetch failed (%r); retrying", exc, exc_info=not isinstance(exc, KafkaError))
        await asyncio.sleep(min(_FETCH_BACKOFF_MAX_S, 0.05 * 2 ** min(self._failures, 7)))

    def _refusal(self, exc: KafkaError) -> str:
        """What the broker refused and the ACL that would allow it."""
        if isinstance(exc, GroupAuthorizationFailedError):
            grant = f"READ on group {self._group}"
        else:  # aiokafka names the topic, when it knows it
            topics = ", ".join(map(str, exc.args)) or ", ".join(self._topics)
            grant = f"READ on topic {topics}"
        return f"Kafka refuses this worker's reads ({exc}): grant its principal {grant}"

    def assigned(self) -> bool:
        """Whether the group gave this worker at least one partition, taken over (readiness)."""
        return bool(self._kafka.assignment() - self._held)

    def lag(self) -> dict[TP, int]:
        """Per assigned partition, records not fetched yet (by this worker's position).

        Partitions not fetched from since their assignment are left out: their
        position is unknown without a request, and a caught-up one adds 0 anyway.
        """
        lag: dict[TP, int] = {}
        for tp in self._kafka.assignment():
            end, fetched = self._kafka.highwater(tp), self._next_offset.get(tp)
            if end is not None and fetched is not None:
                lag[tp] = max(0, end - fetched)
        return lag

    def caught_up(self) -> bool:
        """Whether nothing else is on its way: every assigned partition, none paused or
        held, has a position at its highwater mark as the last fetch response told it.

        aiokafka sets the highwater mark as a response arrives, before its records wait
        in the fetcher's buffer, and moves the position as ``getmany`` hands them out; so a
        position at the mark means nothing fetched is waiting either. A partition not
        fetched yet (no mark) is not caught up. Records appended since the last response
        are not known here: the next fetch brings them.
        """
        assigned = self._kafka.assignment()
        if not assigned or self._paused_topics or self._held:
            return False
        # The subscription state is where aiokafka keeps both numbers (its position() is
        # a coroutine that may ask the broker); read once per batch, not per record.
        subscription = self._kafka._subscription.subscription
        if subscription is None:
            return False
        for tp in assigned:
            state = subscription.assignment.state_value(tp)
            if state is None or state.highwater is None or not state.has_valid_position:
                return False
            if state.position < state.highwater:
                return False
        return True

    def set_paused(self, topics: Set[str]) -> None:
        """Fetch from every assigned partition except those of ``topics`` (backpressure)."""
        if topics == self._paused_topics and not self._pauses_stale:
            return
        self._paused_topics = frozenset(topics)
        self._apply_pauses()

    def _apply_pauses(self) -> None:
        """Pause what backpressure and the assignment handler hold; resume the rest."""
        assigned = self._kafka.assignment()
        wanted = {tp for tp in assigned if tp.topic in self._paused_topics} | (
            self._held & assigned
        )
        paused = self._kafka.paused()
        if wanted - paused:
            self._kafka.pause(*(wanted - paused))
        if paused - wanted:
            self._kafka.resume(*(paused - wanted))
        self._pauses_stale = False

    async def _take_over(self, partitions: set[TopicPartition]) -> None:
        """Hold ``partitions``, run the assignment handler, fetch from committed positions."""
        # Never for a partition no longer ours: its producer would fence the new owner's.
        partitions &= self._kafka.assignment()
        if (self._assigned is None and self._notes is None) or not partitions:
            return
        self._held |= partitions
        self._apply_pauses()
        try:
            if self._assigned is not None:
                await self._assigned({(tp.topic, tp.partition) for tp in partitions})
            await self._seek_to_committed(partitions & self._kafka.assignment())
        except ConfigError as exc:
            self._assign_error = exc  # the partitions stay held: the worker stops
            return
        except Exception as exc:  # the listener's caller would only log it
            log.exception("taking over %s failed", _names(partitions))
            self._assign_error = TakeOverError(f"taking over {_names(partitions)} failed: {exc!r}")
            return
        finally:
            self._pauses_stale = True
        self._held -= partitions
        self._apply_pauses()

    async def _seek_to_committed(self, partitions: set[TopicPartition]) -> None:
        # aiokafka's committed() drops the metadata; its coordinator's call keeps it.
        committed = await self._kafka._coordinator.fetch_committed_offsets(list(partitions))
        for tp in partitions:
            if tp not in self._kafka.assignment():
                continue  # revoked while asking
            found = committed.get(tp)
            if found is None or found.offset < 0:
                position, note = await self._first_position(tp), None
            else:
                position, note = found.offset, found.metadata
            self._kafka.seek(tp, position)
            if self._notes is not None:
                self._notes.resume((tp.topic, tp.partition), position, note)
            self._next_offset.pop((tp.topic, tp.partition), None)

    async def _first_position(self, tp: TopicPartition) -> int:
        """Where a partition that its group never committed starts: its beginning (requests
        sent before any worker started still count); for a shadow, its end; a canary's
        group is placed by ``conveyor canary``, so it refuses."""
        role = self._settings.role
        if role == "canary":
            raise ConfigError(
                f"the canary group {self._group} has no committed position on "
                f"{tp.topic}[{tp.partition}]: start the canary with `conveyor canary --model "
                f"{self._settings.served_name} --share PERCENT` before its workers (it places "
                "the group at the markers that begin its share)"
            )
        ends = await (
            self._kafka.end_offsets([tp])
            if role == "shadow"
            else self._kafka.beginning_offsets([tp])
        )
        return int(ends[tp])

    async def commit(self, positions: Mapping[TP, int]) -> bool:
        """Commit positions of partitions still assigned; False when Kafka refused."""
        assigned = self._kafka.assignment()
        mine = {
            TopicPartition(*tp): position for tp, position in positions.items() if tp in assigned
        }
        if not mine:
            return True
        notes = self._notes
        offsets = mine if notes is None else {tp: (p, notes.note(tp, p)) for tp, p in mine.items()}
        try:
            await self._kafka.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on: these partitions belong to someone else now, who
            # starts from the last commit; results are first-final-wins by request id.
            log.warning("commit of %s failed after a rebalance: %s", _names(mine), exc)
            return False
        except KafkaError as exc:
            log.warning("commit failed, will retry: %s", exc)
            return False
        return True

    async def _revoke(self, revoked: set[TopicPartition]) -> None:
        if self._revoked is not None:
            await self._revoked({(tp.topic, tp.partition) for tp in revoked})
        for tp in revoked:
            self._next_offset.pop(tp, None)

    async def _assign(self, assigned: set[TopicPartition]) -> None:
        # New partitions of paused topics start paused while backpressure holds.
        self._pauses_stale = True
        self._apply_pauses()
        await self._take_over(assigned)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if revoked:
            log.info("partitions revoked: %s; draining them", _names(revoked))
            await self._consumer._revoke(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("partitions assigned: %s", _names(assigned))
        await self._consumer._assign(assigned)


def _names(tps: Mapping[TopicPartition, int] | set[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)) or "none"
