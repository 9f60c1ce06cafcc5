"""Request records: CloudEvents 1.0 Kafka binding, binary content mode.

The attributes travel in record headers and the payload is the raw record
value. ``decode_request`` runs once per record on a worker's hot path, so it
checks the headers by hand and builds the model from the checked values
without a second validation; ``encode_request`` builds a
record and checks it with the very same decoder, so a producer can never send
what a worker would refuse.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, NamedTuple

import orjson
from pydantic import BaseModel, Field

from schemas.dataref import DataRef
from schemas.errors import ContractError, ErrorCode
from schemas.headers import (
    CAPTURETIME_H,
    CONTENT_TYPE_H,
    DATAEXPIRES_H,
    DATAREF_H,
    DEADLINE_H,
    ID_H,
    KNOWN_HEADERS,
    MAX_SEQ,
    PARAMS_H,
    REPLYTO_H,
    REQUEST_TYPE,
    REQUEST_TYPE_RAW,
    REQUIRED_COUNT,
    SEQ_H,
    SOURCE_H,
    SPECVERSION,
    SPECVERSION_H,
    SPECVERSION_RAW,
    STREAM_H,
    SUPERSEDE_H,
    TIME_H,
    TRACEPARENT_H,
    TYPE_H,
    ContentType,
    Header,
    check_no_value,
    check_value,
    expect,
    read_content_type,
    read_dataref,
    read_params,
    read_reply_to,
    read_request_id,
    read_stream,
    read_supersede,
    read_time,
    read_traceparent,
    required_text,
)
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.naming import REQUEST_ID_PATTERN

__all__ = [
    "REQUEST_TYPE",
    "SPECVERSION",
    "ContentType",
    "Header",
    "OutgoingRecord",
    "Request",
    "RequestMeta",
    "decode_request",
    "encode_request",
    "new_request_id",
]


class RequestMeta(BaseModel, frozen=True):
    """The CloudEvents attributes of a request, decoded from its headers."""

    id: Annotated[str, Field(pattern=f"^{REQUEST_ID_PATTERN}$")]
    """``ce_id``: the request id, unique per request, chosen by the producer."""
    specversion: str = SPECVERSION
    """``ce_specversion``: always ``1.0``."""
    type: str = REQUEST_TYPE
    """``ce_type``: always ``conveyor.request.v1`` in this version of the contract."""
    source: Annotated[str, Field(min_length=1)]
    """``ce_source``: who sent the request (free text, for tracing)."""
    time: datetime | None = None
    """``ce_time`` in UTC, when the producer sent it."""
    capture_time: datetime | None = None
    """``ce_capturetime`` in UTC, when the payload was captured (a video frame: when the
    camera took it, or when the producer received it from the camera)."""
    content_type: ContentType
    """``content-type`` of the payload, without parameters."""
    deadline: datetime | None = None
    """``ce_deadline`` in UTC: after it the answer is useless and the request expires."""
    reply_to: str | None = None
    """``ce_replyto``: topic for this request's result instead of the model's results topic."""
    params: dict[str, Any] = Field(default_factory=dict)
    """``ce_params``: per-request parameters for the model (e.g. ``{"top_k": 5}``)."""
    stream: str | None = None
    """``ce_stream``: the video stream (or other ordered sequence) this request belongs to."""
    seq: Annotated[int, Field(ge=0, le=MAX_SEQ)] | None = None
    """``ce_seq``: position in the stream (e.g. frame number)."""
    supersede: bool | None = None
    """``ce_supersede``: whether a newer frame of the same stream, already waiting in the
    worker, may answer this one ``superseded`` (freshest-frame mode); None: the worker's
    setting decides."""
    traceparent: str | None = None
    """W3C ``traceparent``, passed on to the result record."""
    dataref: DataRef | None = None
    """``ce_dataref`` (with ``ce_dataexpires``): where the payload is stored when the
    record carries a reference instead of the bytes (``schemas.dataref``)."""
    timestamp_ms: int
    """The record's Kafka timestamp (epoch ms): when it was produced."""


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request record."""

    meta: RequestMeta
    payload: bytes  # the record value itself, never copied; empty with ``meta.dataref``


class OutgoingRecord(NamedTuple):
    """A record ready for any Kafka producer's send(topic, value, key, headers)."""

    key: bytes  # ce_stream when set (keeps a stream in one partition, in order), else the id
    value: bytes  # the payload, unchanged
    headers: list[tuple[str, bytes]]


def new_request_id() -> str:
    """A fresh random request id (32 hex digits)."""
    return uuid.uuid4().hex


def decode_request(
    headers: Sequence[tuple[str, bytes | None]],
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
    limits: Limits = DEFAULT_LIMITS,
) -> Request:
    """Decode and check one request record; raises ``ContractError`` and nothing else.

    The id is read first, so that every later error carries ``request_id`` and
    the worker can still write an error result for the request. The key only
    chooses the partition and is not checked: producers may key as they like.
    A known header that appears more than once is an error, not "last wins",
    because two readers of the same record must never see different requests.
    """
    found: dict[str, bytes | None] = {}
    duplicate: str | None = None
    total = 0
    for name, raw in headers:
        total += len(name) if raw is None else len(name) + len(raw)
        if name in KNOWN_HEADERS:
            if duplicate is None and name in found:
                duplicate = name
            found[name] = raw
    request_id = read_request_id(found, duplicate, limits)
    try:
        if total > limits.max_headers_total_bytes:
            raise ContractError(
                ErrorCode.bad_request,
                "headers",
                "record headers are too large in total, in bytes",
                limit=limits.max_headers_total_bytes,
                seen=total,
            )
        if duplicate is not None:
            raise ContractError(
                ErrorCode.bad_request, duplicate, "header appears more than once; send it once"
            )
        meta = _decode_meta(found, request_id, timestamp_ms, limits)
        payload = check_value(value, limits) if meta.dataref is None else check_no_value(value)
    except ContractError as err:
        err.request_id = request_id
        raise
    return Request(meta, payload)


def encode_request(
    payload: bytes,
    *,
    request_id: str,
    content_type: ContentType | str,
    source: str,
    params: Mapping[str, Any] | None = None,
    deadline: datetime | None = None,
    reply_to: str | None = None,
    stream: str | None = None,
    seq: int | None = None,
    supersede: bool | None = None,
    traceparent: str | None = None,
    time: datetime | None = None,
    capture_time: datetime | None = None,
    dataref: str | None = None,
    dataexpires: datetime | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> OutgoingRecord:
    """Build a request record; raises ``ContractError`` if a worker would refuse it.

    Datetimes must be timezone-aware; they are sent in UTC. ``params`` must be
    JSON-serialisable with finite floats (orjson writes NaN as null). With
    ``dataref`` (``schemas.dataref``) the payload is stored elsewhere and
    ``payload`` must be empty.
    """
    # Text is encoded with surrogatepass so that a lone surrogate reaches the
    # decoder as invalid UTF-8 and fails there, as a ContractError.
    headers: list[tuple[str, bytes]] = [
        (SPECVERSION_H, SPECVERSION_RAW),
        (ID_H, _utf8(request_id)),
        (TYPE_H, REQUEST_TYPE_RAW),
        (SOURCE_H, _utf8(source)),
        (CONTENT_TYPE_H, _utf8(str(content_type))),
    ]
    for name, moment in ((TIME_H, time), (CAPTURETIME_H, capture_time), (DEADLINE_H, deadline)):
        if moment is not None:
            headers.append((name, _format_time(name, moment)))
    if reply_to is not None:
        headers.append((REPLYTO_H, _utf8(reply_to)))
    if params:
        headers.append((PARAMS_H, _dump_params(params)))
    if stream is not None:
        headers.append((STREAM_H, _utf8(stream)))
    if seq is not None:
        headers.append((SEQ_H, str(seq).encode()))
    if supersede is not None:
        headers.append((SUPERSEDE_H, b"true" if supersede else b"false"))
    if traceparent is not None:
        headers.append((TRACEPARENT_H, _utf8(traceparent)))
    if dataref is not None:
        headers.append((DATAREF_H, _utf8(dataref)))
    if dataexpires is not None:
        headers.append((DATAEXPIRES_H, _format_time(DATAEXPIRES_H, dataexpires)))
    key = _utf8(stream if stream is not None else request_id)
    decoded = decode_request(headers, key, payload, 0, limits)
    if traceparent is not None and decoded.meta.traceparent is None:
        # The decoder ignores a malformed traceparent (W3C says so); a producer
        # that passes one explicitly wants to hear about it.
        raise ContractError(
            ErrorCode.bad_request,
            TRACEPARENT_H,
            "is not a W3C trace context (version-traceid-parentid-flags, lowercase hex)",
            seen=traceparent,
            request_id=decoded.meta.id,
        )
    return OutgoingRecord(key, payload, headers)


def _decode_meta(
    found: Mapping[str, bytes | None], request_id: str, timestamp_ms: int, limits: Limits
) -> RequestMeta:
    expect(found, SPECVERSION_H, SPECVERSION_RAW)
    expect(found, TYPE_H, REQUEST_TYPE_RAW)
    content_type = read_content_type(found, limits)
    source = required_text(found, SOURCE_H, limits.max_header_value_bytes)
    if not source:
        raise ContractError(ErrorCode.bad_request, SOURCE_H, "must not be empty")
    fields: dict[str, Any] = {
        "id": request_id,
        "specversion": SPECVERSION,
        "type": REQUEST_TYPE,
        "source": source,
        "time": None,
        "capture_time": None,
        "content_type": content_type,
        "deadline": None,
        "reply_to": None,
        "params": {},
        "stream": None,
        "seq": None,
        "supersede": None,
        "traceparent": None,
        "dataref": None,
        "timestamp_ms": timestamp_ms,
    }
    # The required headers are all present by now, so any other known one is optional.
    if len(found) > REQUIRED_COUNT:
        _read_optional(found, fields, limits)
    return _trusted_meta(fields)


def _read_optional(
    found: Mapping[str, bytes | None], fields: dict[str, Any], limits: Limits
) -> None:
    fields["time"] = read_time(found, TIME_H, limits)
    fields["capture_time"] = read_time(found, CAPTURETIME_H, limits)
    fields["deadline"] = read_time(found, DEADLINE_H, limits)
    fields["reply_to"] = read_reply_to(found, limits)
    fields["params"] = read_params(found, limits)
    fields["stream"], fields["seq"] = read_stream(found, limits)
    fields["supersede"] = read_supersede(found, fields["stream"])
    fields["traceparent"] = read_traceparent(found, limits)
    fields["dataref"] = read_dataref(found, limits)


def _trusted_meta(fields: dict[str, Any]) -> RequestMeta:
    """A RequestMeta from checked values, built as ``model_construct`` builds it.

    ``model_construct`` would cost as much as all of the checks together
    (it looks up aliases and defaults field by field), and this runs once per
    record. A unit test holds this equal to ``model_construct`` so that a
    pydantic upgrade that changes the recipe fails loudly.
    """
    meta = RequestMeta.__new__(RequestMeta)
    object.__setattr__(meta, "__dict__", fields)
    object.__setattr__(meta, "__pydantic_fields_set__", set(fields))
    object.__setattr__(meta, "__pydantic_extra__", None)
    object.__setattr__(meta, "__pydantic_private__", None)
    return meta


def _utf8(text: str) -> bytes:
    return text.encode(errors="surrogatepass")


def _format_time(name: str, value: datetime) -> bytes:
    if value.utcoffset() is None:
        raise ContractError(
            ErrorCode.bad_request, name, "needs a timezone-aware datetime", seen=value.isoformat()
        )
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ContractError(
            ErrorCode.bad_request, name, "is out of range in UTC", seen=value.isoformat()
        ) from None
    return (utc.replace(tzinfo=None).isoformat() + "Z").encode()


def _dump_params(params: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(dict(params))
    except TypeError as exc:
        raise ContractError(
            ErrorCode.bad_request, PARAMS_H, f"cannot be written as JSON: {exc}"
        ) from None
