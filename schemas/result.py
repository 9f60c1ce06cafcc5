"""Result documents: the JSON a worker writes to Redis and to the reply topic.

One document per request, the same bytes in both places. Readers ignore
fields they do not know and keep error codes they do not know as plain
strings, so a later version of the contract may add both (docs/contract.md).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Self

import orjson
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from schemas.errors import ContractError, ErrorCode
from schemas.naming import REQUEST_ID_PATTERN, is_valid_request_id
from schemas.request import SPECVERSION, ContentType, new_request_id

RESULT_TYPE = "conveyor.result.v1"
_RESULT_TYPE_RAW = RESULT_TYPE.encode()
_SPECVERSION_RAW = SPECVERSION.encode()
_JSON_RAW = ContentType.JSON.value.encode()

# Bad input is an ``error`` (DESIGN.md: bad input gives `error` with a clear code);
# ``rejected`` is kept for records that are not v1 requests at all.
_REJECTED_CODES = frozenset({ErrorCode.unsupported_type})
_EXPIRED_CODES = frozenset({ErrorCode.expired, ErrorCode.superseded})


class Status(StrEnum):
    """How a request ended. Every accepted request gets exactly one final result."""

    ok = "ok"
    """The model ran; ``outputs`` holds the answer and ``error`` is null."""
    error = "error"
    """A well-formed request could not be answered: its payload did not decode or
    was too large once decoded (``decode_failed``, ``image_too_large``), its
    referenced payload could not be read (``dataref_*``), it was cancelled
    (``cancelled``), or the model or worker failed (``model_error``,
    ``out_of_memory``, ``internal``)."""
    expired = "expired"
    """The answer stopped being useful before the model ran, so the model was skipped:
    ``ce_deadline`` passed (code ``expired``) or, in freshest-frame mode, a newer frame
    of the same stream was already waiting (code ``superseded``)."""
    rejected = "rejected"
    """The record broke the wire contract (``bad_request``, ``unsupported_type``,
    ``unsupported_media_type``, ``payload_too_large``): sending it again fails the same way."""


def status_for(code: ErrorCode | str) -> Status:
    """The status a worker gives a result with this error code."""
    if code in _EXPIRED_CODES:
        return Status.expired
    return Status.rejected if code in _REJECTED_CODES else Status.error


class ErrorInfo(BaseModel, frozen=True):
    """Why a result is not ``ok``."""

    code: ErrorCode | str
    """An ``ErrorCode``; a code from a later contract version stays a plain string."""
    message: str
    """A sentence for the user: what was wrong, the limit and the value seen."""

    @field_validator("code", mode="before")
    @classmethod
    def _known_code(cls, value: object) -> object:
        if isinstance(value, str) and not isinstance(value, ErrorCode):
            try:
                return ErrorCode(value)
            except ValueError:
                return value
        return value


class Timings(BaseModel, frozen=True):
    """Where the time went for one request. All instants are epoch milliseconds."""

    produced_ms: int
    """The request record's Kafka timestamp."""
    received_ms: float
    """When the worker fetched the record."""
    batch_start_ms: float | None = None
    """When its batch started in the model stage (with cancellation or status tracking,
    when its check was sent, just before its work); null when it never reached the model."""
    finished_ms: float
    """When the result was ready to publish."""
    queue_ms: float
    """From received to batch start (or to finished, without a batch): time waiting in
    the worker."""
    inference_ms: float
    """Time in the model for the whole batch, from the start of its work (``batch_start_ms``
    or, with a check, just after it): collating it (on a GPU, decoding and uploading its
    images), the forward and its postprocessing."""
    batch_size: Annotated[int, Field(ge=0)]
    """Requests in the batch; 0 when it never reached the model."""
    published_ms: float | None = None
    """When the worker sent the result to Redis; it is durable there one round trip
    later, and on the reply topic once the broker acknowledges it. Null in documents
    of workers older than this field."""


class Result(BaseModel, frozen=True):
    """The final answer to one request."""

    id: Annotated[str, Field(pattern=f"^{REQUEST_ID_PATTERN}$")]
    """The request id (``ce_id`` of the request)."""
    status: Status
    model: str
    """Name of the model that served the request."""
    model_version: str
    outputs: Any = None
    """Task-specific JSON (for classification a list of ``{label, index, score}``);
    null unless ``status`` is ``ok``."""
    error: ErrorInfo | None = None
    """Null exactly when ``status`` is ``ok``."""
    timings: Timings | None = None
    worker: str
    """Which worker process wrote the result."""
    attempt: Annotated[int, Field(ge=1)] = 1
    """How many times a worker started this request, this time included, when the
    workers track status (``--track-status``); 1 otherwise (a redelivered request is
    then recognised in Redis, its first answer stays, but not counted)."""

    @model_validator(mode="after")
    def _status_matches_error(self) -> Self:
        if self.status is Status.ok:
            if self.error is not None:
                raise ValueError("an ok result has no error")
        elif self.error is None:
            raise ValueError(f"a result with status {self.status.value} needs an error")
        elif self.outputs is not None:
            raise ValueError(f"a result with status {self.status.value} has no outputs")
        return self


def ok_result(
    request_id: str,
    outputs: Any,
    *,
    model: str,
    model_version: str,
    worker: str,
    timings: Timings | None = None,
    attempt: int = 1,
) -> Result:
    """An ``ok`` result carrying the model's outputs."""
    return Result(
        id=request_id,
        status=Status.ok,
        model=model,
        model_version=model_version,
        outputs=outputs,
        timings=timings,
        worker=worker,
        attempt=attempt,
    )


def error_result(
    request_id: str,
    code: ErrorCode | str,
    message: str,
    *,
    model: str,
    model_version: str,
    worker: str,
    timings: Timings | None = None,
    status: Status = Status.error,
    attempt: int = 1,
) -> Result:
    """A result that is not ``ok``; pass ``status=status_for(code)`` to follow the contract."""
    return Result(
        id=request_id,
        status=status,
        model=model,
        model_version=model_version,
        error=ErrorInfo(code=code, message=message),
        timings=timings,
        worker=worker,
        attempt=attempt,
    )


def encode_result(result: Result) -> bytes:
    """The result document as JSON bytes, for Redis and the reply topic alike.

    Raises ``ContractError`` (code ``internal``) when ``outputs`` holds
    something JSON cannot represent; NumPy arrays and scalars are written as
    lists and numbers.
    """
    try:
        return orjson.dumps(result.model_dump(), option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise ContractError(
            ErrorCode.internal,
            "outputs",
            f"cannot be written as JSON: {exc}",
            request_id=result.id,
        ) from None


def decode_result(data: bytes) -> Result:
    """Read a result document; raises ``ContractError`` (code ``decode_failed``) on garbage.

    Unknown fields are ignored, so documents from later contract versions read fine.
    """
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ContractError(
            ErrorCode.decode_failed, "result", f"is not UTF-8 JSON: {exc}", seen=data
        ) from None
    if not isinstance(document, dict):
        raise ContractError(ErrorCode.decode_failed, "result", "must be a JSON object", seen=data)
    try:
        return Result.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        request_id = document.get("id")
        raise ContractError(
            ErrorCode.decode_failed,
            f"result.{where}" if where else "result",
            first["msg"],
            seen=first["input"] if where else None,
            request_id=request_id
            if isinstance(request_id, str) and is_valid_request_id(request_id)
            else None,
        ) from None


def result_headers(result: Result, traceparent: str | None = None) -> list[tuple[str, bytes]]:
    """CloudEvents headers for a result record on the reply topic.

    ``ce_subject`` is the request id; ``ce_id`` is a fresh id of the result event.
    Pass the request's ``traceparent`` to continue its trace.
    """
    headers = [
        ("ce_specversion", _SPECVERSION_RAW),
        ("ce_id", new_request_id().encode()),
        ("ce_type", _RESULT_TYPE_RAW),
        ("ce_source", f"/conveyor/{result.model}/{result.worker}".encode(errors="replace")),
        ("ce_subject", result.id.encode()),
        ("content-type", _JSON_RAW),
    ]
    if traceparent is not None:
        headers.append(("traceparent", traceparent.encode(errors="replace")))
    return headers
