"""The worker's stages, wired as asyncio tasks around a pure batcher.

    fetch ──▶ decode + preprocess (thread pool) ──▶ collect ──▶ batch ──▶ infer (model thread)
                                                                                │
    commit ◀── finish offsets ◀── publish (Redis, reply topic, DLQ) ◀───────────┘

Every record fetched ends in exactly one ``Answer`` (ok, error or expired result,
and/or a dead letter), and its offset is finished only after the publisher made
that answer durable. Inference runs in one dedicated thread, at most
``_MODEL_SLOTS`` batches deep, so the next batch forms (and the previous one is
published) while the current one runs; while the model is busy, arrivals pile up
and the next batch comes out fuller: adaptive batching without a tuning knob.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from aiokafka import TopicPartition

from schemas import (
    ContractError,
    ErrorCode,
    ModelTopics,
    Request,
    Timings,
    decode_request,
    result_headers,
)
from workers.answers import Answer, AnswerBuilder
from workers.batcher import Batch, Batcher
from workers.consumer import Consumer, Record
from workers.handlers import Handler
from workers.metrics import Metrics
from workers.publisher import Outgoing, Publisher
from workers.runner import ModelRunner
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

_MODEL_SLOTS = 2  # batches queued on the model thread: one running, one ready to go
_FETCH_TIMEOUT_MS = 100
_DECODE_CHUNK = 64  # records per thread-pool job: amortises the hand-off cost


@dataclass(slots=True)
class Item:
    """A decoded request on its way to the model."""

    record: Record
    request: Request
    received_ms: float  # wall clock, epoch ms: comparable with the producer's timestamp
    received_at: float  # monotonic seconds: for waiting and deadlines
    deadline_at: float | None  # monotonic seconds
    tensor: torch.Tensor


@dataclass(slots=True)
class _Stats:
    answered: int = 0
    duplicates: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Pipeline:
    """Runs the stages until stopped, then drains: every fetched record is answered."""

    def __init__(
        self,
        settings: WorkerSettings,
        consumer: Consumer,
        publisher: Publisher,
        runner: ModelRunner,
        handler: Handler,
        topics: ModelTopics,
        metrics: Metrics,
    ) -> None:
        self._s = settings
        self._metrics = metrics
        self._consumer = consumer
        self._publisher = publisher
        self._runner = runner
        self._handler = handler
        self._topics = topics
        self._answers = AnswerBuilder(settings.served_name, handler.version, settings.worker_id)
        self._batcher: Batcher[Item] = Batcher(
            settings.max_batch_size, settings.max_delay_s, deadline_of=lambda item: item.deadline_at
        )
        self._decode_pool = ThreadPoolExecutor(settings.decode_threads, "conveyor-decode")
        self._model_thread = ThreadPoolExecutor(1, "conveyor-model")
        self._model_slots = asyncio.Semaphore(_MODEL_SLOTS)
        self._decoding: asyncio.Queue[asyncio.Future[list[Item | Answer]] | None] = asyncio.Queue()
        self._ready: deque[Item] = deque()
        self._arrived = asyncio.Event()
        self._input_done = False
        self._to_publish: asyncio.Queue[asyncio.Future[list[Answer]] | list[Answer] | None] = (
            asyncio.Queue()
        )
        self.stats = _Stats()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then finish everything already fetched."""
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._fetch_loop(stop), name="fetch")
                tasks.create_task(self._collect_loop(), name="collect")
                tasks.create_task(self._batch_loop(), name="batch")
                tasks.create_task(self._publish_loop(), name="publish")
        finally:
            self._decode_pool.shutdown(wait=False, cancel_futures=True)
            self._model_thread.shutdown(wait=False, cancel_futures=True)

    # -- fetch and decode ---------------------------------------------------------------

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                self._consumer.set_paused(self._consumer.in_flight() >= self._s.max_in_flight)
                fetch = asyncio.ensure_future(
                    self._consumer.fetch(_FETCH_TIMEOUT_MS, self._s.max_batch_size * 4)
                )
                await asyncio.wait({fetch, stopping}, return_when=asyncio.FIRST_COMPLETED)
                records = await fetch  # a fetch in progress still completes: its records count
                self._metrics.set_in_flight(self._consumer.in_flight())
                self._metrics.set_lag(self._consumer.lag())
                if not records:
                    # Idle: retry a commit that failed earlier (e.g. during a broker outage).
                    await self._consumer.commit_finished()
                for start in range(0, len(records), _DECODE_CHUNK):
                    chunk = records[start : start + _DECODE_CHUNK]
                    await self._decoding.put(
                        loop.run_in_executor(self._decode_pool, self._decode, chunk)
                    )
        finally:
            stopping.cancel()
            await self._decoding.put(None)

    def _decode(self, records: Sequence[Record]) -> list[Item | Answer]:
        """Thread pool: contract-decode and preprocess each record; failures become answers."""
        out: list[Item | Answer] = []
        now_ms, now = time.time() * 1000.0, time.monotonic()
        for record in records:
            request_id = None
            try:
                request = decode_request(
                    record.headers, record.key, record.value, record.timestamp, self._s.limits
                )
                meta = request.meta
                request_id = meta.id
                tensor = self._handler.preprocess(request.payload, meta.content_type, meta.params)
            except ContractError as exc:
                request_id = exc.request_id or request_id
                log.warning(
                    "request %s failed: %s: %s",
                    request_id,
                    exc.code.value,
                    exc,
                    extra={"request_id": request_id},
                )
                out.append(
                    self._answers.failure(
                        record,
                        exc.code,
                        str(exc),
                        field=exc.field,
                        request_id=request_id,
                        received_ms=now_ms,
                    )
                )
                continue
            except Exception as exc:  # a handler bug fails this record, never the worker
                log.exception(
                    "preprocess failed on record %s", request_id, extra={"request_id": request_id}
                )
                message = f"the model's preprocess failed on this input: {exc!r}"
                out.append(
                    self._answers.failure(
                        record,
                        ErrorCode.model_error,
                        message,
                        field=None,
                        request_id=request_id,
                        received_ms=now_ms,
                    )
                )
                continue
            deadline_at = self._deadline(meta.deadline, record.timestamp, now, now_ms)
            out.append(Item(record, request, now_ms, now, deadline_at, tensor))
        return out

    def _deadline(
        self, deadline: datetime | None, produced_ms: int, now: float, now_ms: float
    ) -> float | None:
        """The request's deadline on the monotonic clock: ce_deadline or the max age, if set."""
        limits_ms = []
        if deadline is not None:
            limits_ms.append(deadline.timestamp() * 1000.0)
        if self._s.max_age_ms is not None:
            limits_ms.append(produced_ms + self._s.max_age_ms)
        if not limits_ms:
            return None
        return now + (min(limits_ms) - now_ms) / 1000.0

    async def _collect_loop(self) -> None:
        """Take decoded chunks in fetch order; items go to the batcher, failures to publish."""
        while (chunk := await self._decoding.get()) is not None:
            decoded = await chunk
            failures = [a for a in decoded if isinstance(a, Answer)]
            if failures:
                await self._to_publish.put(failures)
            self._ready.extend(i for i in decoded if isinstance(i, Item))
            self._arrived.set()
        self._input_done = True
        self._arrived.set()

    # -- batch and infer ----------------------------------------------------------------

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._model_slots.acquire()
                batch = await self._next_batch()
                if batch is None:
                    self._model_slots.release()
                    return
                self._metrics.batch_closed(batch.reason)
                if batch.expired:
                    expired = [
                        self._answers.expired(i.record, i.request.meta, i.received_ms)
                        for i in batch.expired
                    ]
                    await self._to_publish.put(expired)
                if not batch.items:
                    self._model_slots.release()
                    continue
                future = loop.run_in_executor(self._model_thread, self._infer, batch)
                future.add_done_callback(lambda _: self._model_slots.release())
                await self._to_publish.put(future)
        finally:
            await self._to_publish.put(None)

    async def _next_batch(self) -> Batch[Item] | None:
        """Wait for the batcher to close a batch; None once the input is done and drained."""
        while True:
            now = time.monotonic()
            if self._ready:
                self._batcher.add_many(self._ready, now)
                self._ready.clear()
            backlog = not self._decoding.empty()
            batch = self._batcher.poll(now, backlog=backlog)
            if batch is not None:
                return batch
            if self._input_done:
                rest = self._batcher.drain(now)
                return rest[0] if rest else None
            deadline = self._batcher.next_deadline()
            self._arrived.clear()
            try:
                timeout = None if deadline is None else max(0.0, deadline - now)
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except TimeoutError:
                pass

    def _infer(self, batch: Batch[Item]) -> list[Answer]:
        """Model thread: run the batch; a failing batch is bisected so bad items fail alone."""
        start_ms, start = time.time() * 1000.0, time.monotonic()
        outcomes = self._run_isolated(batch.items)
        inference_ms = (time.monotonic() - start) * 1000.0
        finished_ms = time.time() * 1000.0
        queue_s = [start - item.received_at for item in batch.items]
        self._metrics.observe_batch(len(batch.items), queue_s, inference_ms / 1000)
        answers = []
        for item, outcome in zip(batch.items, outcomes, strict=True):
            timings = Timings(
                produced_ms=item.record.timestamp,
                received_ms=item.received_ms,
                batch_start_ms=start_ms,
                finished_ms=finished_ms,
                queue_ms=start_ms - item.received_ms,
                inference_ms=inference_ms,
                batch_size=len(batch.items),
            )
            if isinstance(outcome, _Failure):
                answers.append(
                    self._answers.failure(
                        item.record,
                        outcome.code,
                        outcome.message,
                        field=None,
                        request_id=item.request.meta.id,
                        received_ms=item.received_ms,
                        timings=timings,
                    )
                )
            else:
                answers.append(self._answers.ok(item.record, item.request.meta, outcome, timings))
        return answers

    def _run_isolated(self, items: Sequence[Item]) -> list[Any]:
        try:
            return self._runner.run(
                [i.tensor for i in items], [i.request.meta.params for i in items]
            )
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()  # give the halves the memory the failed batch held
            if len(items) == 1:
                return [_Failure(ErrorCode.out_of_memory, f"out of memory even alone: {exc}")]
        except ContractError as exc:  # e.g. a JPEG that only fails when decoded in batch
            if len(items) == 1:
                return [_Failure(exc.code, str(exc))]
        except Exception as exc:
            if len(items) == 1:
                request_id = items[0].request.meta.id
                log.warning(
                    "model failed on request %s: %r",
                    request_id,
                    exc,
                    extra={"request_id": request_id},
                )
                return [_Failure(ErrorCode.model_error, f"model failed on this input: {exc!r}")]
        half = len(items) // 2
        return self._run_isolated(items[:half]) + self._run_isolated(items[half:])

    # -- publish and commit ---------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while True:
            unit = await self._to_publish.get()
            if unit is None:
                return
            answers = list(await unit) if isinstance(unit, asyncio.Future) else list(unit)
            # Publish everything already waiting in one round-trip.
            while not self._to_publish.empty():
                more = self._to_publish.get_nowait()
                if more is None:
                    await self._publish(answers)
                    return
                answers.extend(await more if isinstance(more, asyncio.Future) else more)
            await self._publish(answers)

    async def _publish(self, answers: Sequence[Answer]) -> None:
        outgoing, dead = [], []
        counts: dict[str, int] = {}
        for answer in answers:
            if answer.result is not None:
                data = self._answers.encode(answer)
                outgoing.append(
                    Outgoing(
                        answer.result.id,
                        data,
                        result_headers(answer.result, answer.traceparent),
                        answer.reply_to or self._topics.results,
                    )
                )
                status = answer.result.status.value
                counts[status] = counts.get(status, 0) + 1
                self.stats.by_status[status] = self.stats.by_status.get(status, 0) + 1
            if answer.dead is not None:
                dead.append(answer.dead)
        report = await self._publisher.publish(outgoing, dead)
        durable_ms = time.time() * 1000.0
        self._metrics.observe_results(
            counts,
            [(durable_ms - a.record.timestamp) / 1000 for a in answers if a.result is not None],
        )
        self._metrics.dead_letters(len(dead))
        self._metrics.duplicates(report.duplicates)
        self.stats.answered += len(answers)
        self.stats.duplicates += report.duplicates
        await self._consumer.finish([(_tp(a.record), a.record.offset) for a in answers])
        await self._consumer.commit_finished()


@dataclass(slots=True)
class _Failure:
    code: ErrorCode
    message: str


def _tp(record: Record) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)
