"""The worker's stages, wired as asyncio tasks around a pure batcher; the unit is the batch.

    fetch ─▶ parse (loop) ─▶ preprocess (pool or inline) ─▶ collect ─▶ batch ─▶ infer (thread)
                   │ refusals                                                     │
    commit ◀─ finish spans ◀─ publish (Redis script + producer batches) ◀─ outcomes ◀┘
                               (up to ``publishes_in_flight`` at once: workers.delivery.stage)

Every record fetched ends in exactly one answer (an item the model answered, or a
refusal: bad input, expired, superseded, model failure), and its span is finished
only after that answer is durable (``workers.offsets``); a failed device
(``DeviceLost``) stops the worker instead, its batches left to another member. The
delivery policy (``workers.delivery.policies``: at least once, or exactly once with Kafka
transactions) writes answers and decides when positions are committed. Work
crosses stages as typed messages (``workers.types``); per-record Python is a strict
header parse, the handler's preprocess, one encoded document per result and one
decrement per finished record; the rest (Redis, the producer, metrics, commits)
happens once per batch or per publish.

The pipeline depends on ports, not on aiokafka and redis-py: ``RecordSource``
(``workers.kafka.consumer.Consumer`` in production) and ``ResultSink``
(``workers.publish.publisher.Publisher``), so tests drive it in-process with fakes.

A batch closes when it is full, when its oldest item waited ``max_delay``, at once when
more records wait to be preprocessed (``backlog``), and at once when nothing else is on
its way (``idle``: the source caught up with every partition, nothing fetched waits), so
a lone request on an idle worker never waits for the timer.

Backpressure: fetching pauses while the records in flight exceed what the model
gets through in ``in_flight_target_ms`` (measured), capped by ``max_in_flight``,
never below two batches; so a revoked partition drains in about that long,
well inside the group's rebalance timeout. With priority lanes
(``workers.batching.lanes``) the budget is shared by weight, lane by lane, and each batch
comes from one lane. In freshest-frame mode (``workers.batching.freshest``) a waiting
frame with a newer frame of its stream behind it is answered ``superseded``,
before its payload is decoded when both came in one fetch, else when the next
batch closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from schemas import topics_for
from workers.batching.batcher import Batch
from workers.batching.freshest import LatestFrames
from workers.batching.lanes import LaneBatcher, LaneTopics
from workers.config.worker import WorkerSettings
from workers.delivery.policies import delivery_for
from workers.delivery.stage import Publishing
from workers.handlers.base import BatchPreprocess, Costed, Handler
from workers.intake.admission import Admission
from workers.intake.canary import Split
from workers.intake.ingest import INLINE_BYTES, Ingest
from workers.intake.references import Claims
from workers.model.inference import Inference, expired_refusal, superseded_refusal
from workers.model.runner import ModelRunner
from workers.observe.metrics import Metrics
from workers.offsets import OffsetTracker
from workers.publish.answers import Answers
from workers.types import (
    ConfigError,
    DeviceLost,
    Item,
    ModelStage,
    Outcome,
    Record,
    RecordSource,
    Refusal,
    ResultSink,
    TopicPartition,
    TransactionalSink,
)

if TYPE_CHECKING:  # imported only when tracing is on: it loads the OpenTelemetry SDK
    from workers.generation.stage import GenerationRunner  # and only for generation: transformers
    from workers.observe.tracing import Tracing

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_MS = 100
_PREPROCESS_CHUNK = 64  # items per thread-pool job: amortises the hand-off cost

Decoded = tuple[list[Item], list[Refusal]]


class _Decoding(NamedTuple):
    """A chunk of one lane's items on its way through preprocessing."""

    lane: int
    items: list[Item]  # what went in
    decoded: Awaitable[Decoded]


class Pipeline:
    """Runs the stages until stopped, then drains: every fetched record is answered."""

    def __init__(
        self,
        settings: WorkerSettings,
        source: RecordSource,
        sink: ResultSink,
        runner: ModelRunner | GenerationRunner,
        answers: Answers,
        metrics: Metrics,
        *,
        claims: Claims | None = None,
        admission: Admission | None = None,
        transactions: TransactionalSink | None = None,
        tracing: Tracing | None = None,
        split: Split | None = None,
    ) -> None:
        """``claims`` reads payloads by reference (none: every reference is refused);
        ``admission`` checks each batch for cancellations and marks it running as the
        model stage starts it (none: off);
        ``transactions``: deliver exactly once through them (none: at least once);
        ``tracing`` makes spans of the requests that carry a trace context (none: off).
        ``split``: which records this worker's group answers under canary markers (the
        one the source commits notes of; none: a split of its own for its role)."""
        self._s = settings
        self._source = source
        self._metrics = metrics
        handler: Handler = runner.handler
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._delivery = delivery_for(
            answers, sink, self._tracker, source, transactions, settings.publishes_in_flight
        )
        self._ingest = Ingest(handler, settings.limits, settings.max_age_ms, metrics)
        self._split = split or Split(settings.role)
        self._claims = claims or Claims.from_settings(settings, metrics, {})
        self._inference: ModelStage
        self._floor = 2 * settings.max_batch_size  # in flight: a batch running, the next forming
        if isinstance(runner, ModelRunner):
            self._inference = Inference(
                runner,
                self._finished,
                batches=settings.stage_batches,
                partial=settings.stage_partial_batches,
                admission=admission,
            )
        else:  # a running engine: each request joins it alone (workers.generation)
            from workers.generation.stage import Generating

            generating = Generating(
                runner, self._finished, metrics.define_generation(), admission=admission
            )
            self._floor = 2 * generating.capacity  # the engine full, as many waiting
            self._inference = generating
        topics = topics_for(settings.served_name, settings.topic_prefix)
        self._lanes = LaneTopics(settings.request_lanes, topics)
        if self._lanes.several:
            metrics.define_lanes(self._lanes.names)
        self._tokenizes = isinstance(handler, BatchPreprocess)
        costs: dict[str, Any] = {}
        if isinstance(handler, Costed):  # text: batches by tokens, a stream's frames in order
            costs = {
                "cost_of": lambda item: handler.cost(item.tensor),
                "max_cost": settings.max_batch_tokens,
                "group_of": _stream_of,
            }
        self._batcher: LaneBatcher[Item] = LaneBatcher(
            self._lanes.weights, settings.max_batch_size, settings.max_delay_s, _deadline, **costs
        )
        self._frames: LatestFrames[Item] = LatestFrames(self._freshest_stream)
        self._pool = ThreadPoolExecutor(settings.decode_threads, "conveyor-decode")
        self._decoding: asyncio.Queue[_Decoding | None] = asyncio.Queue()
        self._ready: list[tuple[int, list[Item]]] = []  # preprocessed chunks by lane
        self._arrived = asyncio.Event()  # items arrived, or a batch left the stage
        self._input_done = False
        self._collecting = False  # a chunk taken off _decoding is still being preprocessed
        self._fetch: asyncio.Future[Mapping[TopicPartition, Sequence[Record]]] | None = None
        self._ingested = asyncio.Event()  # set each time the fetch loop took a fetch's records
        self._publishing = Publishing(self._delivery, metrics, self._lanes, tracing)
        self._outcomes = self._publishing.outcomes
        self._progress = self._publishing.progress
        source.on_revoke(self._release)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then finish everything already fetched."""
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._fetch_loop(stop), name="fetch")
                tasks.create_task(self._collect_loop(), name="collect")
                tasks.create_task(self._batch_loop(), name="batch")
                tasks.create_task(self._publishing.run(), name="publish")
            await self._delivery.flush()
        except BaseExceptionGroup as group:
            # A configuration error or a failed device ends the worker (exit status 3, 7).
            own = group.subgroup(lambda e: isinstance(e, (ConfigError, DeviceLost)))
            if own is not None:
                raise _first_leaf(own) from None
            raise
        finally:
            await self._delivery.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._inference.close()

    def in_flight_cap(self) -> int:
        """Records fetched ahead at most: ``in_flight_target_ms`` of measured model time."""
        floor = self._floor
        per_item = self._inference.seconds_per_item
        if per_item is None:  # nothing measured yet
            target = floor
        elif per_item <= 0:
            target = self._s.max_in_flight
        else:
            target = max(floor, int(self._s.in_flight_target_ms / 1000.0 / per_item))
        return min(self._s.max_in_flight, target)

    # -- fetch, parse, preprocess -------------------------------------------------------

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                in_flight = self._tracker.in_flight()
                paused = self._lanes.paused(
                    in_flight, self.in_flight_cap(), self._tracker.in_flight_by_partition
                )
                self._source.set_paused(paused)
                fetch = self._fetch = asyncio.ensure_future(
                    self._source.fetch(_FETCH_TIMEOUT_MS, self._s.max_batch_size * 4)
                )
                try:  # however this ends, no revocation waits for these records after it
                    await asyncio.wait({fetch, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    chunks = await fetch  # a fetch in progress still completes: its records count
                    for tp, records in chunks.items():
                        if records:
                            self._ingest_chunk(tp, records)
                finally:
                    self._fetch = None
                    self._ingested.set()
                if self._s.close_idle_batches and len(self._batcher):
                    self._arrived.set()  # the source may have caught up: a waiting batch may close
                self._metrics.set_in_flight(in_flight)
                self._metrics.set_lag(self._lag())
                if not chunks:
                    await self._delivery.flush()  # idle: retry a commit that failed before
        finally:
            stopping.cancel()
            await self._decoding.put(None)

    def _ingest_chunk(self, tp: TopicPartition, records: Sequence[Record]) -> None:
        span = self._tracker.open(tp, records[0].offset, records[-1].offset, len(records))
        records, skipped = self._split.take(tp, records)
        if skipped:  # canary markers, and requests the model's other group answers
            self._tracker.finish(span, skipped)
            self._metrics.skipped(skipped, self._split.latest)
            self._delivery.skipped()
            if not records:
                return
        items, refused, referenced = self._ingest.parse(records, span)
        framed = [item for item in items if item.meta.stream is not None]
        if framed:
            self._frames.arrived(framed)
            if self._frames.superseded:  # older frames of one fetch: never decoded
                gone = [item for item in framed if self._frames.is_superseded(item)]
                if gone:
                    left = set(map(id, gone))
                    items = [item for item in items if id(item) not in left]
                    refused += self._superseded(gone)
        if refused:
            self._outcomes.put_nowait(Outcome(refused=refused))
        lane = self._lanes.index[tp[0]]
        if referenced:  # payloads stored elsewhere: fetch them, then preprocess
            resolved = asyncio.ensure_future(self._claims.resolve(items, self._preprocess_fetched))
            self._decoding.put_nowait(_Decoding(lane, items, resolved))
            return
        loop = asyncio.get_running_loop()
        for start in range(0, len(items), _PREPROCESS_CHUNK):
            chunk = items[start : start + _PREPROCESS_CHUNK]
            size = sum(len(item.record.value or b"") for item in chunk)
            # A thread hop would cost more than decoding a few small payloads; tokenizing
            # a chunk of texts (one batch call) is more work, and the Rust tokenizer
            # releases the GIL, so it always goes to the decode threads.
            if size <= INLINE_BYTES and not self._tokenizes:
                done: asyncio.Future[Decoded] = loop.create_future()
                done.set_result(self._ingest.preprocess(chunk))
                self._decoding.put_nowait(_Decoding(lane, chunk, done))
            else:
                decoded = loop.run_in_executor(self._pool, self._ingest.preprocess, chunk)
                self._decoding.put_nowait(_Decoding(lane, chunk, decoded))

    def _freshest_stream(self, item: Item) -> str | None:
        """The item's stream when it is in freshest-frame mode, else None."""
        meta = item.meta
        wanted = self._s.supersede_frames if meta.supersede is None else meta.supersede
        return meta.stream if wanted else None

    def _superseded(self, frames: list[Item]) -> list[Refusal]:
        """Answers for waiting frames that a newer frame of their stream superseded."""
        self._frames.left(frames)
        self._metrics.superseded(len(frames))
        return [superseded_refusal(item) for item in frames]

    async def _preprocess_fetched(self, items: list[Item], payloads: list[bytes]) -> Decoded:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self._ingest.preprocess_payloads, items, payloads
        )

    def _lag(self) -> dict[tuple[str, int], int]:
        """Per partition: records not fetched yet plus those in flight."""
        return {
            tp: behind + self._tracker.in_flight(tp) for tp, behind in self._source.lag().items()
        }

    async def _collect_loop(self) -> None:
        """Take preprocessed chunks in fetch order: items to the batcher, refusals out."""
        while (chunk := await self._decoding.get()) is not None:
            self._collecting = True
            try:
                items, refused = await chunk.decoded
            finally:
                self._collecting = False
            if refused:
                self._outcomes.put_nowait(Outcome(refused=refused))
                if len(self._frames):  # frames that failed to decode wait no more
                    kept = set(map(id, items))
                    self._frames.left(item for item in chunk.items if id(item) not in kept)
            self._ready.append((chunk.lane, items))
            self._arrived.set()
        self._input_done = True
        self._arrived.set()

    # -- batch and infer ----------------------------------------------------------------

    async def _batch_loop(self) -> None:
        try:
            while True:
                await self._inference.wait_for_slot()
                batch = await self._next_batch()
                if batch is None:
                    self._inference.release_slot()
                    return
                self._metrics.batch_closed(batch.reason)
                self._frames.left(batch.items)
                self._frames.left(batch.expired)
                if batch.expired:
                    self._outcomes.put_nowait(
                        Outcome(refused=[expired_refusal(i) for i in batch.expired])
                    )
                # Items of partitions revoked meanwhile are left to their new owner.
                items = [item for item in batch.items if not item.span.released]
                if items:
                    self._inference.submit(items)
                else:
                    self._inference.release_slot()
        finally:
            await self._inference.wait_idle()
            self._outcomes.put_nowait(None)

    async def _next_batch(self) -> Batch[Item] | None:
        """Wait for the batcher to close a batch; None once the input is done and drained."""
        while True:
            now = time.monotonic()
            if self._ready:
                for lane, items in self._ready:
                    self._batcher.add_many(lane, items, now)
                self._ready.clear()
            if self._frames.superseded:
                gone = self._batcher.withdraw(self._frames.is_superseded)
                if gone:
                    self._outcomes.put_nowait(Outcome(refused=self._superseded(gone)))
            # While the stage holds its share of partial batches, the next one grows
            # until it is full or a batch leaves the stage (``_finished`` wakes this).
            partial = self._inference.takes_partial()
            backlog = not self._decoding.empty()
            idle = not backlog and self._idle()
            batch = self._batcher.poll(now, backlog=backlog, full_only=not partial, idle=idle)
            if batch is not None:
                return batch
            if self._input_done:
                rest = self._batcher.drain(now)
                return rest[0] if rest else None
            deadline = self._batcher.next_deadline() if partial else None
            self._arrived.clear()
            try:
                timeout = None if deadline is None else max(0.0, deadline - now)
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except TimeoutError:
                pass

    def _idle(self) -> bool:
        """Whether nothing else is on its way to the batcher (``close_idle_batches``): no
        chunk in preprocessing, no fetch's records waiting for the fetch loop, and the
        source caught up. Then a batch closes at once: waiting ``max_delay`` would delay a
        lone request for company that is not coming. Under a backlog the source is behind
        and batches form as before."""
        if not self._s.close_idle_batches or self._collecting:
            return False
        fetch = self._fetch
        if fetch is not None and fetch.done():
            return False
        return self._source.caught_up()

    def _finished(self, outcome: Outcome) -> None:
        """On the loop, when the model thread is done with a batch."""
        timing = outcome.timing
        if timing is not None:
            start_ms = timing.start_ms
            queue_s = [(start_ms - item.received_ms) / 1000.0 for item in outcome.answered]
            self._metrics.observe_batch(timing.size, queue_s, timing.inference_ms / 1000.0)
            if self._lanes.several and outcome.answered:  # a batch is of one lane
                lane = self._lanes.index[outcome.answered[0].record.topic]
                self._metrics.lane_queue_wait(self._lanes.names[lane], queue_s)
        # The batch loop is woken before the publisher: the next batch need not wait
        # behind this one's publishing.
        self._arrived.set()  # a partial batch may join the stage now
        self._outcomes.put_nowait(outcome)

    # -- rebalance ----------------------------------------------------------------------

    async def _release(self, partitions: Collection[TopicPartition]) -> None:
        """Before ``partitions`` go to another worker: let their work in flight finish
        (up to ``max_drain_ms``), commit, and hand back whatever is still unfinished."""
        deadline = time.monotonic() + self._s.max_drain_ms / 1000.0
        if self._fetch is not None and self._fetch.done():  # records the loop has yet to take
            self._ingested.clear()
            await self._ingested.wait()
        while any(self._tracker.in_flight(tp) for tp in partitions):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), left)
            except TimeoutError:
                break
        await self._delivery.release(partitions)
        handed_back = sum(self._tracker.in_flight(tp) for tp in partitions)
        if handed_back:
            self._metrics.handed_back(handed_back)
            log.warning(
                "%d records of revoked partitions not finished in %d ms; their next owner "
                "answers them (first answer wins)",
                handed_back,
                self._s.max_drain_ms,
            )
        for tp in partitions:
            self._tracker.forget(tp)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception of ``group`` that is not a group (the publishes' own group
    nests inside the stages')."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _deadline(item: Item) -> float | None:
    return item.deadline_at


def _stream_of(item: Item) -> str | None:
    return item.meta.stream
