"""The final word on each record: result documents and dead letters, built one way.

Every record a worker fetches ends in exactly one ``Answer``: a result (when the
record has a usable request id) and/or a dead-letter copy (when it could not be
served). The pipeline decides *which* answer; this module decides what it looks
like, so every path (ok, expired, bad input, model failure) fills in the same
fields.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from schemas import (
    ContractError,
    ErrorCode,
    RequestMeta,
    Result,
    Status,
    Timings,
    dlq_headers,
    encode_result,
    status_for,
)
from workers.consumer import Record
from workers.publisher import DeadLetter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Answer:
    """The final word on one record: a result (if it had a usable id) and/or a dead letter."""

    record: Record
    result: Result | None
    dead: DeadLetter | None = None
    traceparent: str | None = None
    reply_to: str | None = None


class AnswerBuilder:
    """Builds the answers of one worker: its model name and version, its id."""

    def __init__(self, model: str, model_version: str, worker: str) -> None:
        self._model = model
        self._version = model_version
        self._worker = worker

    def ok(self, record: Record, meta: RequestMeta, outputs: Any, timings: Timings) -> Answer:
        result = self._result(meta.id, Status.ok, outputs, None, timings)
        return Answer(record, result, None, meta.traceparent, meta.reply_to)

    def expired(self, record: Record, meta: RequestMeta, received_ms: float) -> Answer:
        """The deadline passed before the model ran: ``expired``, no dead letter."""
        timings = _unbatched(record, received_ms, queued=True)
        deadline = meta.deadline.isoformat() if meta.deadline else "(max age)"
        error = (ErrorCode.expired, f"deadline {deadline} passed before inference")
        result = self._result(meta.id, Status.expired, None, error, timings)
        return Answer(record, result, None, meta.traceparent, meta.reply_to)

    def failure(
        self,
        record: Record,
        code: ErrorCode,
        message: str,
        *,
        field: str | None,
        request_id: str | None,
        received_ms: float,
        timings: Timings | None = None,
    ) -> Answer:
        """An error result (when the record has a usable id) plus a dead-letter copy."""
        headers = dlq_headers(
            record.headers,
            code=code,
            message=message,
            field=field,
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            worker=self._worker,
        )
        dead = DeadLetter(record.key, record.value, headers)
        result = None
        if request_id is not None:
            timings = timings or _unbatched(record, received_ms, queued=False)
            result = self._result(request_id, status_for(code), None, (code, message), timings)
        return Answer(record, result, dead, _header(record, "traceparent"), None)

    def encode(self, answer: Answer) -> bytes:
        """The result document; outputs that JSON cannot carry become an ``internal`` error."""
        assert answer.result is not None
        try:
            return encode_result(answer.result)
        except ContractError as exc:
            log.error("result for %s cannot be encoded: %s", answer.result.id, exc)
            answer.result = self._result(
                answer.result.id,
                Status.error,
                None,
                (ErrorCode.internal, f"the model's output could not be encoded: {exc}"),
                answer.result.timings,
            )
            return encode_result(answer.result)

    def _result(
        self,
        request_id: str,
        status: Status,
        outputs: Any,
        error: tuple[ErrorCode, str] | None,
        timings: Timings | None,
    ) -> Result:
        return Result.model_validate(
            {
                "id": request_id,
                "status": status,
                "model": self._model,
                "model_version": self._version,
                "outputs": outputs,
                "error": None if error is None else {"code": error[0], "message": error[1]},
                "timings": timings,
                "worker": self._worker,
            }
        )


def _unbatched(record: Record, received_ms: float, *, queued: bool) -> Timings:
    """Timings of an answer given without running the model (batch size 0)."""
    now_ms = time.time() * 1000.0
    return Timings(
        produced_ms=record.timestamp,
        received_ms=received_ms,
        batch_start_ms=None,
        finished_ms=now_ms,
        queue_ms=now_ms - received_ms if queued else 0.0,
        inference_ms=0.0,
        batch_size=0,
    )


def _header(record: Record, name: str) -> str | None:
    for key, value in record.headers:
        if key == name:
            try:
                return str(value.decode("utf-8"))
            except (UnicodeDecodeError, AttributeError):
                return None
    return None
