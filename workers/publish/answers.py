"""The final word on each record: result documents and dead letters, one pass per publish.

The pipeline decides *which* answer a record gets (an ``Item`` answered by the
model, or a ``Refusal``); ``Answers.outbox`` decides what it looks like, so every
path (ok, expired, bad input, model failure) fills in the same fields. Documents
are written with ``schemas.fastpath.ResultEncoder`` (equal to the pydantic path
by property tests), reply headers are built per result, and refused records
are copied to the dead-letter topic with the reason in their headers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import ContractError, ErrorCode, Status, dlq_headers, status_for
from schemas.chain import child_of
from schemas.fastpath import ResultEncoder
from workers.offsets import Span
from workers.types import ChildAnswer, DeadLetter, Item, Outbox, Outcome, Parent, Refusal

log = logging.getLogger(__name__)

_OK = Status.ok
_WAITED = frozenset({ErrorCode.expired, ErrorCode.superseded})  # answered after waiting


@dataclass(slots=True)
class Built:
    """What one publish carries, and what its metrics need."""

    outbox: Outbox = field(default_factory=Outbox)
    produced_ms: list[int] = field(default_factory=list)  # per result, for end-to-end time
    statuses: dict[str, int] = field(default_factory=dict)  # results by status
    finished: list[Span] = field(default_factory=list)  # the spans of every record answered


class Answers:
    """Builds the answers of one worker: its model name and version, its id.

    A shadow's answers (``shadow``) are results for its own results topic alone: every
    ``ce_replyto`` is ignored and no record is dead-lettered (``workers.publish.shadow``).

    In a pipeline (``workers.chain``): with ``chained`` (the worker has a next stage),
    every answer the model gave goes to ``Outbox.parents`` rather than the results (also
    that of a child request: its own children's answers are joined to it first); with
    ``children`` (the worker joins), any other answer of a child request
    (``schemas.chain``), whatever its status, goes to ``Outbox.children``. A shadow does
    neither: its answers are its own.
    """

    def __init__(
        self,
        model: str,
        model_version: str,
        worker: str,
        max_result_bytes: int,
        *,
        shadow: bool = False,
        chained: bool = False,
        children: bool = False,
    ) -> None:
        self._encoder = ResultEncoder(model, model_version, worker)
        self._worker = worker
        self._shadow = shadow
        self._chained = chained and not shadow
        self._children = children and not shadow
        self.max_result_bytes = max_result_bytes
        """Largest result document the reply topic takes; larger answers become
        ``result_too_large`` errors in both places."""

    def outbox(self, outcomes: Sequence[Outcome]) -> Built:
        """Encode every answer of ``outcomes`` for one publish."""
        built = Built()
        now_ms = time.time() * 1000.0
        for outcome in outcomes:
            if outcome.answered:
                self._answered(outcome, now_ms, built)
            for refusal in outcome.refused:
                self._refused(refusal, now_ms, built)
        return built

    def _answered(self, outcome: Outcome, now_ms: float, built: Built) -> None:
        timing = outcome.timing
        assert timing is not None
        start_ms, finished_ms = timing.start_ms, timing.finished_ms
        inference_ms, size = timing.inference_ms, timing.size
        add, encode, headers = built.outbox.add, self._encoder.encode, self._encoder.headers
        produced, spans, limit = built.produced_ms, built.finished, self.max_result_bytes
        shadow = self._shadow
        ok = 0
        for item, output in zip(outcome.answered, outcome.outputs, strict=True):
            record, meta = item.record, item.meta
            timings = {
                "produced_ms": record.timestamp,
                "received_ms": item.received_ms,
                "batch_start_ms": start_ms,
                "finished_ms": finished_ms,
                "queue_ms": start_ms - item.received_ms,
                "inference_ms": inference_ms,
                "batch_size": size,
                "published_ms": now_ms,
            }
            answered = False
            try:
                data = encode(meta.id, _OK, output, None, timings, item.attempt)
                if len(data) > limit:
                    data = self._too_large(item, len(data), timings)
                else:
                    ok += 1
                    answered = True
            except ContractError as exc:
                log.error("result for %s cannot be encoded: %s", meta.id, exc)
                message = f"the model's output could not be encoded: {exc}"
                data = self._error(meta.id, ErrorCode.internal, message, timings, built)
            produced.append(record.timestamp)
            spans.append(item.span)
            child = child_of(record.headers) if self._children else None
            if answered and self._chained:
                up = None if child is None else (child.parent, child.index, child.count)
                built.outbox.parents.append(Parent(item, output, data, up))
                continue
            if child is not None:
                built.outbox.children.append(
                    ChildAnswer(
                        meta.id, child.parent, child.index, child.count, data, record.partition
                    )
                )
                continue
            reply_to = None if shadow else meta.reply_to
            add(meta.id, data, headers(meta.id, meta.traceparent), reply_to, record.partition)
        if ok:
            built.statuses[_OK.value] = built.statuses.get(_OK.value, 0) + ok

    @staticmethod
    def _joined(
        request_id: str,
        headers: Any,
        data: bytes,
        partition: int,
        built: Built,
    ) -> bool:
        """Put the answer of a child request in ``built``'s children; False for a plain one."""
        child = child_of(headers)
        if child is None:
            return False
        built.outbox.children.append(
            ChildAnswer(request_id, child.parent, child.index, child.count, data, partition)
        )
        return True

    def _too_large(self, item: Item, size: int, timings: dict[str, Any]) -> bytes:
        log.error(
            "result for %s is %d bytes, more than the reply topic takes (%d)",
            item.meta.id,
            size,
            self.max_result_bytes,
        )
        message = (
            f"the answer is {size} bytes, more than the reply topic accepts "
            f"({self.max_result_bytes}); raise the topic's max.message.bytes or ask for less"
        )
        status = status_for(ErrorCode.result_too_large)
        error = (ErrorCode.result_too_large.value, message)
        return self._encoder.encode(item.meta.id, status, None, error, timings, item.attempt)

    def _error(
        self,
        request_id: str,
        code: ErrorCode,
        message: str,
        timings: Any,
        built: Built,
        attempt: int = 1,
    ) -> bytes:
        status = status_for(code)
        built.statuses[status.value] = built.statuses.get(status.value, 0) + 1
        return self._encoder.encode(
            request_id, status, None, (code.value, message), timings, attempt
        )

    def _refused(self, refusal: Refusal, now_ms: float, built: Built) -> None:
        record = refusal.record
        if refusal.request_id is not None:
            timings = _timings(refusal, now_ms)
            data = self._error(
                refusal.request_id, refusal.code, refusal.message, timings, built, refusal.attempt
            )
            joined = self._children and self._joined(
                refusal.request_id, record.headers, data, record.partition, built
            )
            if not joined:
                built.outbox.add(
                    refusal.request_id,
                    data,
                    self._encoder.headers(refusal.request_id, refusal.traceparent),
                    None if self._shadow else refusal.reply_to,
                    record.partition,
                )
            built.produced_ms.append(record.timestamp)
        if refusal.dead_letter and not self._shadow:
            headers = dlq_headers(
                record.headers,
                code=refusal.code,
                message=refusal.message,
                field=refusal.field,
                source_topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                worker=self._worker,
            )
            built.outbox.dead.append(DeadLetter(record.key, record.value, headers))
        built.finished.append(refusal.span)


def _timings(refusal: Refusal, now_ms: float) -> dict[str, Any]:
    """Timings of a refusal: its batch's when the model ran on it, else batch size 0."""
    batch = refusal.batch
    if batch is not None:
        start_ms, finished_ms, inference_ms, size = (
            batch.start_ms,
            batch.finished_ms,
            batch.inference_ms,
            batch.size,
        )
        queue_ms = start_ms - refusal.received_ms
    else:
        start_ms, finished_ms, inference_ms, size = None, now_ms, 0.0, 0
        queued = refusal.code in _WAITED
        queue_ms = now_ms - refusal.received_ms if queued else 0.0
    return {
        "produced_ms": refusal.record.timestamp,
        "received_ms": refusal.received_ms,
        "batch_start_ms": start_ms,
        "finished_ms": finished_ms,
        "queue_ms": queue_ms,
        "inference_ms": inference_ms,
        "batch_size": size,
        "published_ms": now_ms,
    }
