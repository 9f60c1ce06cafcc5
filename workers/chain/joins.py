"""Pipelines between models: a parent's crops go out as child requests, and the parent's
one result is written once every child is answered.

Each request a chained worker answers (the *parent*) starts a *join*: the Redis hash
``conveyor:join:<parent id>`` (``schemas.chain.join_key``) holding the parent's
document, how many children it has, which of its detections they are, where its
result goes, and, as they come, each child's result document (``c0``, ``c1``, ...).

- **The first stage** (``Joins.emit``): one script call per publish writes each parent's
  join unless one is there (a redelivered parent uses the document stored first, so
  its children are the first run's, whatever this run found); a parent whose result
  is already written gets it back, as any redelivered request. Then the crops are cut
  from the image the model saw (``workers.chain.crops``) and added to the outbox as
  child requests, which the publisher sends, acknowledged, before the parent's
  position is committed (inside the partition's transaction in exactly-once delivery).
- **The next stage** (``Joins.join``): every worker adds the answers of child requests
  to their parents' joins (``HSETNX``: a child answered twice keeps its first answer),
  one script call per publish; the call that completes a join gets all of it back and
  adds the parent's result to the outbox, where it is written as every result is:
  Redis first, first result wins, then the parent's reply topic.

A crash anywhere repeats a step, never changes one: the join and each child are
written once, the parent's result is written once, and the last step is redone by
whichever redelivered child finds the join complete. The scripts touch one key each
(or, for a parent, its join and its result), so a publish costs one Redis call per
stage whatever its size; on a Redis Cluster, one call per hash slot, pipelined per
primary (``workers.chain.scripts``), each join in its result key's slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import orjson
import redis.asyncio as aioredis

from common.redis_cluster import ClusterRouter
from common.security import redis_options
from schemas import ContractError, ErrorCode, result_key, status_for
from schemas.chain import COUNT_H, INDEX_H, PARENT_H, child_id, join_key
from schemas.fastpath import ResultEncoder
from schemas.headers import ContentType
from workers.chain.crops import cut_from
from workers.chain.scripts import (
    CHILD_SCRIPT,
    DEADLINE_SCRIPT,
    PARENT_SCRIPT,
    Item,
    OnCluster,
    OneServer,
    Scripts,
)
from workers.config.next_stage import WHOLE_IMAGE, NextStage
from workers.config.worker import WorkerSettings
from workers.types import Chain, ChildAnswer, Outbox, Parent, PublishReport, Request, ResultSink

log = logging.getLogger(__name__)

T = TypeVar("T")
Retry = Callable[[str, Callable[[], Awaitable[T]]], Awaitable[T]]

_META_FIELDS = 7  # doc, count, boxes, reply, trace, next, up
_SOCKET_TIMEOUT_S = 10.0

_NEW, _STORED, _ANSWERED = 0, 1, 2
_DEADLINE_GRACE_S = 0.5  # after a parent's deadline, before its missing children expire


class Counts(Protocol):
    """Where a publish's pipeline step is counted (``workers.observe.metrics.Metrics``)."""

    def chain(self, sent: int, answered: int, orphans: int) -> None: ...


@dataclass(slots=True)
class _Tally:
    answered: int = 0
    orphans: int = 0


class Joins:
    """The pipeline step of every publish (``workers.types.Chain``): starts the joins of a
    chained worker's answers and adds child answers to theirs.

    ``scripts`` run where the results are kept (one server or a Redis Cluster);
    ``stage`` is the worker's next stage (None: it has none, but still answers children
    of other models' requests); ``retry`` repeats a Redis call through outages (the
    publisher's, so they count for readiness).
    """

    def __init__(
        self,
        scripts: Scripts,
        encoder: ResultEncoder,
        retry: Retry[Any],
        *,
        stage: NextStage | None,
        next_partitions: int,
        ttl_s: int,
        max_pixels: int,
        max_crop_bytes: int,
        max_result_bytes: int,
        results_topic: str,
        worker: str,
        counts: Counts | None = None,
        publish: Callable[[Outbox], Awaitable[Any]] | None = None,
    ) -> None:
        self._scripts = scripts
        self._cluster = scripts.cluster
        self._counts = counts
        self._publish = publish
        self._timers: set[asyncio.Task[None]] = set()
        self._encoder = encoder
        self._retry = retry
        self._stage = stage
        self._next_partitions = next_partitions
        self._ttl_s = ttl_s
        self._max_pixels = max_pixels
        self._max_crop_bytes = max_crop_bytes
        self._max_result_bytes = max_result_bytes
        self._results_topic = results_topic
        self._source = f"conveyor.chain/{worker}".encode()

    @classmethod
    def open(
        cls,
        settings: WorkerSettings,
        encoder: ResultEncoder,
        retry: Retry[Any],
        *,
        stage: NextStage | None,
        next_partitions: int,
        max_crop_bytes: int,
        max_result_bytes: int,
        results_topic: str,
        counts: Counts | None = None,
        publish: Callable[[Outbox], Awaitable[Any]] | None = None,
    ) -> Joins:
        url = settings.redis_url.get_secret_value()
        options = {"socket_timeout": _SOCKET_TIMEOUT_S, **redis_options(settings)}
        scripts: Scripts
        if settings.redis_cluster:
            scripts = OnCluster(ClusterRouter(url, options))
            join_key("0", cluster=True)  # each slot's hash tag, found now rather than mid-publish
        else:
            scripts = OneServer(aioredis.Redis.from_url(url, **options))
        return cls(
            scripts,
            encoder,
            retry,
            stage=stage,
            next_partitions=next_partitions,
            ttl_s=settings.result_ttl_s,
            max_pixels=settings.limits.max_pixels,
            max_crop_bytes=max_crop_bytes,
            max_result_bytes=max_result_bytes,
            results_topic=results_topic,
            worker=settings.worker_id,
            counts=counts,
            publish=publish,
        )

    async def aclose(self) -> None:
        """Stop waiting for deadlines (a parent whose children all come is answered by
        them still), then give back the connection."""
        for timer in list(self._timers):
            timer.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
        await self._scripts.aclose()

    async def settle(self, outbox: Outbox) -> None:
        """Start the joins of ``outbox.parents`` (adding their child requests, or their
        results when they have none) and add ``outbox.children`` to theirs (adding the
        results of the parents they complete)."""
        requests, tally = len(outbox.requests), _Tally()  # calls overlap: a tally each
        if outbox.parents:
            await self.emit(outbox)
        if outbox.children:
            await self.join(outbox, tally)
        if self._counts is not None:
            self._counts.chain(len(outbox.requests) - requests, tally.answered, tally.orphans)

    # -- the first stage ----------------------------------------------------------------

    async def emit(self, outbox: Outbox) -> None:
        """Write the joins of ``outbox.parents``, then their child requests."""
        stage = self._stage
        assert stage is not None, "parents come only from a worker with a next stage"
        given, outbox.parents = outbox.parents, []
        parents = []
        for parent in given:
            if stage.takes(parent.output):
                parents.append(parent)
            else:  # a classification, say: nothing to send on, its answer as it is
                meta = parent.item.meta
                self._add_result(outbox, meta.id, parent.document, parent, meta.reply_to)
        if not parents:
            return
        chosen = [stage.select(parent.output) for parent in parents]
        items = []
        for parent, indices in zip(parents, chosen, strict=True):
            meta = parent.item.meta
            keys = [join_key(meta.id, cluster=self._cluster), result_key(meta.id)]
            reply = meta.reply_to or self._results_topic
            args = [
                parent.document,
                len(indices),
                orjson.dumps(indices),
                reply,
                meta.traceparent or "",
                stage.model,
                b"" if parent.up is None else orjson.dumps(parent.up),
            ]
            items.append((keys, args))
        found = await self._retry(
            "redis", lambda: self._scripts.each(PARENT_SCRIPT, items, [self._ttl_s])
        )
        failed: list[ChildAnswer] = []
        for parent, indices, (state, *stored) in zip(parents, chosen, found, strict=True):
            meta = parent.item.meta
            if state == _ANSWERED:  # its result is written: it goes out again, unchanged
                self._add_result(outbox, meta.id, parent.document, parent, meta.reply_to)
                continue
            document, output = parent.document, parent.output
            if state == _STORED and stored[0] != document:
                document = stored[0]
                output = orjson.loads(document)["outputs"]
                indices = stage.select(output)
            if not indices:
                final = self._final(meta.id, document, [], stage.model, {})
                self._add_result(outbox, meta.id, final, parent, meta.reply_to)
                continue
            failed += await self._requests(outbox, parent, output, indices)
            if meta.deadline is not None and parent.up is None:
                self._expire_at(parent, meta.deadline)
        outbox.children += failed  # joined next, in ``settle``

    async def _requests(
        self, outbox: Outbox, parent: Parent, output: Any, indices: list[int]
    ) -> list[ChildAnswer]:
        """Add the child requests of ``parent`` to ``outbox``; the answers of those that
        could not be sent (a crop that cannot be cut, or too large) come back."""
        stage = self._stage
        assert stage is not None
        item, meta = parent.item, parent.item.meta
        if indices == [WHOLE_IMAGE]:
            boxes: list[Sequence[float]] = [
                (0, 0, output.get("width", 1e9), output.get("height", 1e9))
            ]
        else:
            boxes = [output["detections"][i]["box"] for i in indices]
        count = len(indices)
        try:
            crops = await asyncio.to_thread(
                cut_from,
                item.tensor,
                item.record.value or b"",
                ContentType(meta.content_type),
                boxes,
                0.0 if stage.whole_image else stage.margin,
                max_pixels=self._max_pixels,
                limit=self._max_crop_bytes,
                size=stage.size,
                shape=_shape(output),
            )
        except (ContractError, ValueError, OSError) as exc:
            log.error("the crops of %s could not be cut: %s", meta.id, exc)
            message = f"the crop could not be cut from the image: {exc}"
            return [
                self._failed(meta.id, i, count, self._partition_of(parent), message)
                for i in range(count)
            ]
        failed = []
        common = self._common_headers(parent, count)
        key = None if meta.stream is None else meta.stream.encode()
        for index, (content_type, crop) in enumerate(crops):
            request = child_id(meta.id, index)
            if len(crop) > self._max_crop_bytes:
                message = (
                    f"the crop is {len(crop)} bytes as PNG, more than the next model's "
                    f"request topic takes ({self._max_crop_bytes}); ask for a smaller "
                    "then_options size, or raise the topic's max.message.bytes"
                )
                partition = self._partition_of(parent)
                failed.append(self._failed(meta.id, index, count, partition, message))
                continue
            record_key = key or request.encode()
            headers = [
                ("ce_id", request.encode()),
                ("content-type", content_type.value.encode()),
                *common,
                (INDEX_H, str(index).encode()),
            ]
            partition = zlib.crc32(record_key) % self._next_partitions
            outbox.requests.append(Request(stage.topic, partition, record_key, crop, headers))
        return failed

    def _partition_of(self, parent: Parent) -> int:
        """The partition a parent's result is placed by (``p mod N`` of its reply topic):
        for a frame of a stream, the next model's partition of the stream's children, so
        that every result of a stream, with children or not, goes to one reply partition."""
        stream = parent.item.meta.stream
        if stream is None or self._stage is None:
            return parent.item.record.partition
        return zlib.crc32(stream.encode()) % self._next_partitions

    def _common_headers(self, parent: Parent, count: int) -> list[tuple[str, bytes]]:
        stage = self._stage
        assert stage is not None
        meta = parent.item.meta
        headers = [
            ("ce_specversion", b"1.0"),
            ("ce_type", b"conveyor.request.v1"),
            ("ce_source", self._source),
            (PARENT_H, meta.id.encode()),
            (COUNT_H, str(count).encode()),
        ]
        if meta.deadline is not None:
            headers.append(("ce_deadline", meta.deadline.isoformat().encode()))
        if meta.traceparent is not None:
            headers.append(("traceparent", meta.traceparent.encode()))
        if stage.params is not None:
            headers.append(("ce_params", stage.params))
        return headers

    def _failed(
        self, parent: str, index: int, count: int, partition: int, message: str
    ) -> ChildAnswer:
        """The answer of a child that was never sent: an error, as its model would give."""
        request = child_id(parent, index)
        code = ErrorCode.internal
        document = self._encoder.encode(
            request, status_for(code), None, (code.value, message), None
        )
        return ChildAnswer(request, parent, index, count, document, partition)

    def _expire_at(self, parent: Parent, deadline: datetime) -> None:
        """Answer ``parent`` just after its deadline with the children it has, the
        others ``expired``, unless every child is answered first (``publish`` only).
        The timer keeps the parent's id, trace and partition, never its image."""
        if self._publish is None:
            return
        delay = (deadline - datetime.now(UTC)).total_seconds() + _DEADLINE_GRACE_S
        meta, partition = parent.item.meta, self._partition_of(parent)
        timer = asyncio.create_task(self._at_deadline(meta.id, partition, max(delay, 0.0)))
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _at_deadline(self, parent: str, partition: int, delay: float) -> None:
        await asyncio.sleep(delay)
        item: Item = ([join_key(parent, cluster=self._cluster), result_key(parent)], [])
        try:
            (state,) = await self._retry(
                "redis", lambda: self._scripts.each(DEADLINE_SCRIPT, [item])
            )
            if not isinstance(state, list):
                return  # answered, or every child in: the last child's worker writes it
            fields = dict(zip(state[::2], state[1::2], strict=True))
            outbox = Outbox()
            self._add_joined(outbox, parent, fields, partition)
            assert self._publish is not None
            await self._publish(outbox)  # first result wins: a last child's, if it came
            log.info(
                "request %s passed its deadline before all its children were answered: "
                "its result written, the missing children expired",
                parent,
            )
        except Exception:  # the last child's answer still completes it
            log.exception("writing the result of %s at its deadline failed", parent)

    # -- the next stage -----------------------------------------------------------------

    async def join(self, outbox: Outbox, tally: _Tally | None = None) -> None:
        """Add ``outbox.children`` to their joins; add the results of the parents they
        complete to ``outbox`` (a child whose join is gone becomes a result of its own).
        A completed parent that is itself a child joins its own parent in turn."""
        tally = tally or _Tally()
        while outbox.children:
            await self._join_round(outbox, tally)

    async def _join_round(self, outbox: Outbox, tally: _Tally) -> None:
        children, outbox.children = outbox.children, []
        items = [
            (
                [join_key(child.parent, cluster=self._cluster)],
                [child.count, child.index, child.document],
            )
            for child in children
        ]
        found = await self._retry("redis", lambda: self._scripts.each(CHILD_SCRIPT, items))
        done: set[str] = set()
        for child, state in zip(children, found, strict=True):
            if state == -1:
                tally.orphans += 1
                log.warning(
                    "request %s is child %d of %s, which has no join of that many children "
                    "(expired after result_ttl_s, or never started): answered under its own id",
                    child.request_id,
                    child.index,
                    child.parent,
                )
                outbox.add(
                    child.request_id,
                    child.document,
                    self._encoder.headers(child.request_id, None),
                    None,
                    child.partition,
                )
            elif isinstance(state, list) and child.parent not in done:
                done.add(child.parent)
                fields = dict(zip(state[::2], state[1::2], strict=True))
                tally.answered += self._complete(outbox, child, fields)

    def _complete(self, outbox: Outbox, child: ChildAnswer, fields: dict[bytes, bytes]) -> int:
        """Add the complete parent's result to ``outbox`` (1), or its answer to its own
        parent's join (0)."""
        up = fields.get(b"up")
        if up:  # this parent is a child of another: its answer joins that one's
            grand, index, count = orjson.loads(up)
            final = self._final_of(child.parent, fields)
            outbox.children.append(
                ChildAnswer(child.parent, grand, index, count, final, child.partition)
            )
            return 0
        self._add_joined(outbox, child.parent, fields, child.partition)
        return 1

    def _add_joined(
        self, outbox: Outbox, parent: str, fields: dict[bytes, bytes], partition: int
    ) -> None:
        """Add the result a join's ``fields`` make to ``outbox``, for its reply topic."""
        trace = fields[b"trace"].decode() or None
        headers = self._encoder.headers(parent, trace)
        final = self._final_of(parent, fields)
        outbox.add(parent, final, headers, fields[b"reply"].decode(), partition)

    def _final_of(self, parent: str, fields: dict[bytes, bytes]) -> bytes:
        """The parent's result from its join: the children it has (all, once complete)."""
        indices = orjson.loads(fields[b"boxes"])
        answers = {i: fields[c] for i in range(len(indices)) if (c := f"c{i}".encode()) in fields}
        return self._final(parent, fields[b"doc"], indices, fields[b"next"].decode(), answers)

    def _final(
        self,
        parent: str,
        document: bytes,
        indices: Sequence[int],
        model: str,
        answers: dict[int, bytes],
    ) -> bytes:
        """The parent's result: its document, each chosen detection with its child's
        answer under ``next``, ``outputs.pipeline`` saying which children failed, and
        ``timings.published_ms`` now (from the request's production to it: every stage)."""
        result = orjson.loads(document)
        outputs = result["outputs"]
        detections = outputs.get("detections", []) if isinstance(outputs, dict) else []
        failed = []
        for i, j in enumerate(indices):
            child = orjson.loads(answers[i]) if i in answers else _expired(parent, i, model)
            if child["status"] != "ok":
                failed.append(i)
            answer = {
                "id": child["id"],
                "model": child["model"],
                "model_version": child["model_version"],
                "status": child["status"],
                "outputs": child["outputs"],
                "error": child["error"],
            }
            if j == WHOLE_IMAGE:
                outputs["next"] = answer
            else:
                detections[j]["next"] = answer
        if isinstance(outputs, dict):
            outputs["pipeline"] = {"model": model, "children": len(indices), "failed": failed}
        if isinstance(result.get("timings"), dict):  # sent now: its children's time counts
            result["timings"]["published_ms"] = time.time() * 1000.0
        final = orjson.dumps(result)
        if len(final) <= self._max_result_bytes:
            return final
        message = (
            f"the answer with its {len(indices)} children's answers is {len(final)} bytes, "
            f"more than the reply topic accepts ({self._max_result_bytes}); ask for fewer "
            "children (then_options max_children) or raise the topic's max.message.bytes"
        )
        code = ErrorCode.result_too_large
        return self._encoder.encode(parent, status_for(code), None, (code.value, message), None)

    def _add_result(
        self, outbox: Outbox, request_id: str, document: bytes, parent: Parent, reply_to: str | None
    ) -> None:
        """``parent``'s answer, complete: a result, or, for a parent that is itself a
        child, its answer to its own parent's join."""
        partition = self._partition_of(parent)
        if parent.up is not None:
            up, index, count = parent.up
            outbox.children.append(ChildAnswer(request_id, up, index, count, document, partition))
            return
        headers = self._encoder.headers(request_id, parent.item.meta.traceparent)
        outbox.add(request_id, document, headers, reply_to, partition)


def _shape(output: dict[str, Any]) -> tuple[int, int] | None:
    """The submitted image's (width, height) an answer gives, if it gives them."""
    width, height = output.get("width"), output.get("height")
    return (width, height) if isinstance(width, int) and isinstance(height, int) else None


def _expired(parent: str, index: int, model: str) -> dict[str, Any]:
    """The answer of a child that its parent's deadline found unanswered."""
    message = "the request's deadline passed before this child was answered"
    return {
        "id": child_id(parent, index),
        "model": model,
        "model_version": None,
        "status": status_for(ErrorCode.expired).value,
        "outputs": None,
        "error": {"code": ErrorCode.expired.value, "message": message},
    }


class Chained:
    """A result sink that runs the pipeline step (``Joins.settle``) on each outbox first."""

    def __init__(self, chain: Chain, sink: ResultSink) -> None:
        self._chain = chain
        self._sink = sink

    async def publish(self, outbox: Outbox) -> PublishReport:
        await self._chain.settle(outbox)
        return await self._sink.publish(outbox)
