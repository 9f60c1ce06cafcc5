"""Ingest: fetched records become items for the model, or refusals, a partition chunk at a time.

``Ingest.parse`` runs on the event loop: one strict header parse per record
(``schemas.fastpath.parse_request``), falling back to the full decoder only for
records the fast parse does not take, which either decode after all or get the
decoder's precise error; it also says whether any request of the chunk carries
its payload by reference (``ce_dataref``: only the full decoder reads those), so
that the pipeline fetches them first (``workers.intake.references``). ``Ingest.preprocess``
turns payloads into tensors with
the handler's ``preprocess``; it is thread-safe, so the pipeline runs chunks of
large payloads (images: Pillow releases the GIL while it decodes) in a thread
pool, and chunks of small ones inline, where a thread hop would cost more than
the work.

Nothing here can raise for a record: whatever a producer sent ends as an
``Item`` or a ``Refusal`` (``workers.types``).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from schemas import ContractError, ErrorCode, Limits, RequestMeta, decode_request, is_valid_topic
from schemas.fastpath import FastMeta, parse_request
from schemas.headers import ID_CHARS, read_traceparent
from workers.handlers.base import BatchPreprocess, Handler
from workers.kafka.records import REPAIRED
from workers.observe.metrics import Metrics
from workers.offsets import Span
from workers.types import Item, Record, Refusal

log = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024
"""Chunks whose payloads add up to no more than this are preprocessed on the event loop."""

_VALUE = operator.attrgetter("record.value")


class Parsed(NamedTuple):
    """A partition chunk, parsed."""

    items: list[Item]
    refused: list[Refusal]
    referenced: bool  # some item carries its payload by reference (``meta.dataref``)


class Ingest:
    """Parses and preprocesses records for one handler under one set of limits."""

    def __init__(
        self, handler: Handler, limits: Limits, max_age_ms: int | None, metrics: Metrics
    ) -> None:
        self._handler = handler
        self._limits = limits
        self._max_age_ms = max_age_ms
        self._metrics = metrics

    def parse(self, records: Sequence[Record], span: Span) -> Parsed:
        """Contract-check a partition's fetched records (all of ``span``), in order."""
        now_ms, now = time.time() * 1000.0, time.monotonic()
        items: list[Item] = []
        refused: list[Refusal] = []
        referenced = False
        limits, max_age_ms = self._limits, self._max_age_ms
        for record in records:
            meta = parse_request(record.headers, record.value, limits)
            if meta is None or record.checksum is not None:
                meta = self._slow(record, span, now_ms, refused)
                if meta is None:
                    continue
                referenced = referenced or meta.dataref is not None
            deadline_at = None
            if meta.deadline is not None or max_age_ms is not None:
                deadline_at = _deadline(meta, record.timestamp, max_age_ms, now, now_ms)
            items.append(Item(record, span, meta, now_ms, deadline_at))
        return Parsed(items, refused, referenced)

    def preprocess(self, items: Sequence[Item]) -> tuple[list[Item], list[Refusal]]:
        """Run the handler's ``preprocess`` on each item's record value."""
        # Parse refused records without a value, and sent those with a reference to claims.
        return self.preprocess_payloads(items, map(_VALUE, items))

    def preprocess_payloads(
        self, items: Sequence[Item], payloads: Iterable[bytes]
    ) -> tuple[list[Item], list[Refusal]]:
        """Run the handler's ``preprocess`` on each item with its payload (``payloads[i]``
        for ``items[i]``); failures become refusals."""
        ready: list[Item] = []
        refused: list[Refusal] = []
        handler = self._handler
        if isinstance(handler, BatchPreprocess):
            payloads = list(payloads)
            try:
                done = handler.preprocess_batch(
                    payloads, [i.meta.content_type for i in items], [i.meta.params for i in items]
                )
            except Exception:  # a handler bug: each item alone, through preprocess below
                log.exception("preprocess_batch failed on a chunk of %d", len(items))
            else:
                return self._batch_done(items, done)
        preprocess = handler.preprocess
        for item, payload in zip(items, payloads, strict=True):
            meta = item.meta
            try:
                item.tensor = preprocess(payload, meta.content_type, meta.params)
            except ContractError as exc:
                log.warning(
                    "request %s failed: %s: %s",
                    meta.id,
                    exc.code.value,
                    exc,
                    extra={"request_id": meta.id},
                )
                refused.append(Refusal.of(item, exc.code, str(exc), exc.field))
                continue
            except Exception as exc:  # a handler bug fails this record, never the worker
                log.exception(
                    "preprocess failed on request %s", meta.id, extra={"request_id": meta.id}
                )
                message = f"the model's preprocess failed on this input: {exc!r}"
                refused.append(Refusal.of(item, ErrorCode.model_error, message))
                continue
            ready.append(item)
        return ready, refused

    def _batch_done(
        self, items: Sequence[Item], done: Sequence[torch.Tensor | ContractError]
    ) -> tuple[list[Item], list[Refusal]]:
        """``preprocess_batch``'s answers as items ready and refusals."""
        ready: list[Item] = []
        refused: list[Refusal] = []
        for item, answer in zip(items, done, strict=True):
            if isinstance(answer, ContractError):
                meta = item.meta
                log.warning(
                    "request %s failed: %s: %s",
                    meta.id,
                    answer.code.value,
                    answer,
                    extra={"request_id": meta.id},
                )
                refused.append(Refusal.of(item, answer.code, str(answer), answer.field))
            else:
                item.tensor = answer
                ready.append(item)
        return ready, refused

    def _slow(
        self, record: Record, span: Span, now_ms: float, refused: list[Refusal]
    ) -> FastMeta | None:
        """The full decoder's answer: the request's metadata, or a refusal added."""
        if record.checksum == REPAIRED:
            refused.append(_unreadable(record, span, now_ms, self._limits))
            self._metrics.unreadable_records()
            return None
        try:
            request = decode_request(
                record.headers, record.key, record.value, record.timestamp, self._limits
            )
        except ContractError as exc:
            log.warning(
                "request %s refused: %s: %s",
                exc.request_id,
                exc.code.value,
                exc,
                extra={"request_id": exc.request_id},
            )
            refused.append(
                Refusal(
                    record,
                    span,
                    exc.code,
                    str(exc),
                    exc.field,
                    exc.request_id,
                    now_ms,
                    reply_to=_reply_to(record),
                    traceparent=read_traceparent(_found(record), self._limits),
                )
            )
            return None
        return _from_meta(request.meta)


def _deadline(
    meta: FastMeta, produced_ms: int, max_age_ms: int | None, now: float, now_ms: float
) -> float:
    """The request's deadline on the monotonic clock: ce_deadline or the max age, earlier."""
    limits_ms = []
    if meta.deadline is not None:
        limits_ms.append(meta.deadline.timestamp() * 1000.0)
    if max_age_ms is not None:
        limits_ms.append(produced_ms + max_age_ms)
    return now + (min(limits_ms) - now_ms) / 1000.0


def _from_meta(meta: RequestMeta) -> FastMeta:
    return FastMeta(
        meta.id,
        meta.content_type,
        meta.params,
        meta.deadline,
        meta.reply_to,
        meta.stream,
        meta.seq,
        meta.traceparent,
        meta.supersede,
        meta.dataref,
    )


def _unreadable(record: Record, span: Span, now_ms: float, limits: Limits) -> Refusal:
    """A record whose header names are not all UTF-8 (``workers.kafka.records``)."""
    names = [name for name, _ in record.headers if not _utf8(name)]
    shown = ", ".join(repr(name.encode("utf-8", "surrogateescape")) for name in names)
    request_id = _header_text(record, "ce_id")
    if request_id is not None and (
        len(request_id) > limits.max_id_length or ID_CHARS.fullmatch(request_id.encode()) is None
    ):
        request_id = None
    log.warning(
        "record %s[%d]@%d refused: header names %s are not UTF-8",
        record.topic,
        record.partition,
        record.offset,
        shown,
        extra={"request_id": request_id},
    )
    return Refusal(
        record,
        span,
        ErrorCode.bad_request,
        f"header names must be UTF-8; these are not: {shown}",
        "headers",
        request_id,
        now_ms,
    )


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reply_to(record: Record) -> str | None:
    """The record's ce_replyto when it names a valid topic: error results go there too."""
    topic = _header_text(record, "ce_replyto")
    return topic if topic is not None and is_valid_topic(topic) else None


def _found(record: Record) -> dict[str, bytes | None]:
    return dict(record.headers)


def _header_text(record: Record, name: str) -> str | None:
    """A header's value as text when it is there once and is UTF-8, else None."""
    values = [raw for key, raw in record.headers if key == name]
    if len(values) != 1 or values[0] is None:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        return None
