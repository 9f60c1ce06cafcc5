"""The gateway's refusals: an HTTP status, a code and a sentence, whatever the protocol.

``Refused`` is raised by a route and answered in its protocol's error shape (the Open
Inference Protocol's ``{"error", "code"}``, OpenAI's ``{"error": {...}}``).
``queue_refusal`` turns the queue's errors (``Gateway`` and the SDK's) into one, and
``result_refusal`` a result that is not ``ok``: the same statuses on every route.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from producers.errors import (
    ClientError,
    ConnectionsBusy,
    InvalidInput,
    RecordTooLarge,
    ServiceUnavailable,
    UnknownModel,
)
from producers.gateway.service import AnswerTimeout, Overloaded
from schemas import ContractError, ErrorCode, Result

T = TypeVar("T")

RESULT_STATUS: dict[str, int] = {
    ErrorCode.expired: 504,
    ErrorCode.superseded: 409,
    ErrorCode.cancelled: 409,
    ErrorCode.payload_too_large: 413,
    ErrorCode.model_error: 500,
    ErrorCode.out_of_memory: 500,
    ErrorCode.internal: 500,
    ErrorCode.result_too_large: 500,
}
"""The HTTP status of a result's error code; every other code is the caller's input: 400."""


class Refused(Exception):
    """An HTTP error: ``status``, Conveyor's ``code``, a sentence, headers and extra fields."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.extra: dict[str, Any] = {}
        """More fields of the error body (``id``, ``pending``, ``result``)."""


def queue_refusal(exc: Exception, retry_after_s: int, request_id: str | None) -> Refused | None:
    """The refusal for an error of the queue's, or None for an error that is not one."""
    if isinstance(exc, AnswerTimeout):
        refused = Refused(504, "timeout", str(exc))
        refused.extra = {"id": request_id, "pending": list(exc.request_ids)}
        refused.extra["result"] = f"/v2/results/{exc.request_ids[0]}"
        return refused
    if isinstance(exc, Overloaded):
        return Refused(429, "overloaded", str(exc), {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, UnknownModel):
        return Refused(404, "unknown_model", str(exc))
    if isinstance(exc, RecordTooLarge):
        return Refused(413, ErrorCode.payload_too_large, str(exc))
    if isinstance(exc, ServiceUnavailable | ConnectionsBusy):
        return Refused(503, "unavailable", str(exc), {"Retry-After": str(retry_after_s)})
    if isinstance(exc, ContractError):
        return Refused(400, exc.code, str(exc))
    if isinstance(exc, InvalidInput | ClientError):
        return Refused(400, ErrorCode.bad_request, str(exc))
    return None


async def queued(work: Awaitable[T], retry_after_s: int, request_id: str | None = None) -> T:
    """``work``'s answer, with the queue's errors raised as their refusals (``queue_refusal``)."""
    try:
        return await work
    except Exception as exc:
        refused = queue_refusal(exc, retry_after_s, request_id)
        if refused is None:
            raise
        raise refused from None


def result_refusal(result: Result) -> Refused:
    """The refusal that answers a result that is not ``ok`` (its code, and its status)."""
    assert result.error is not None  # a result that is not ok has one
    code = str(result.error.code)
    refused = Refused(RESULT_STATUS.get(code, 400), code, result.error.message)
    refused.extra = {"id": result.id}
    return refused
