"""Request records: CloudEvents 1.0 Kafka binding, binary content mode.

The attributes travel in record headers and the payload is the raw record
value. ``decode_request`` runs once per record on a worker's hot path, so it
checks the headers by hand and builds the model from the checked values
without a second validation; ``encode_request`` builds a
record and checks it with the very same decoder, so a producer can never send
what a worker would refuse.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, NamedTuple

import orjson
from pydantic import BaseModel, Field

from schemas.dataref import DataRef, parse_dataref
from schemas.errors import ContractError, ErrorCode
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.naming import REQUEST_ID_PATTERN, is_valid_topic

SPECVERSION = "1.0"
REQUEST_TYPE = "conveyor.request.v1"


class Header(StrEnum):
    """Names of the request headers (matched exactly, case-sensitive)."""

    SPECVERSION = "ce_specversion"
    ID = "ce_id"
    TYPE = "ce_type"
    SOURCE = "ce_source"
    TIME = "ce_time"
    CONTENT_TYPE = "content-type"
    DEADLINE = "ce_deadline"
    REPLYTO = "ce_replyto"
    PARAMS = "ce_params"
    STREAM = "ce_stream"
    SEQ = "ce_seq"
    SUPERSEDE = "ce_supersede"
    TRACEPARENT = "traceparent"
    DATAREF = "ce_dataref"
    DATAEXPIRES = "ce_dataexpires"


class ContentType(StrEnum):
    """Media types a request payload may have."""

    JPEG = "image/jpeg"
    PNG = "image/png"
    WEBP = "image/webp"
    NPY = "application/x-npy"
    JSON = "application/json"
    TEXT = "text/plain"


# Plain str constants: looking up an enum member costs more on the hot path.
_SPECVERSION_H = Header.SPECVERSION.value
_ID_H = Header.ID.value
_TYPE_H = Header.TYPE.value
_SOURCE_H = Header.SOURCE.value
_TIME_H = Header.TIME.value
_CONTENT_TYPE_H = Header.CONTENT_TYPE.value
_DEADLINE_H = Header.DEADLINE.value
_REPLYTO_H = Header.REPLYTO.value
_PARAMS_H = Header.PARAMS.value
_STREAM_H = Header.STREAM.value
_SEQ_H = Header.SEQ.value
_SUPERSEDE_H = Header.SUPERSEDE.value
_TRACEPARENT_H = Header.TRACEPARENT.value
_DATAREF_H = Header.DATAREF.value
_DATAEXPIRES_H = Header.DATAEXPIRES.value
_KNOWN_HEADERS = frozenset(h.value for h in Header)
_REQUIRED_COUNT = 5  # ce_specversion, ce_id, ce_type, ce_source, content-type
_MEDIA_TYPES = {c.value: c for c in ContentType}
# The exact bytes almost every producer sends; the slow path handles case and parameters.
_MEDIA_TYPES_RAW = {c.value.encode(): c for c in ContentType}
_SPECVERSION_RAW = SPECVERSION.encode()
_REQUEST_TYPE_RAW = REQUEST_TYPE.encode()
_ID_CHARS = re.compile(rb"[A-Za-z0-9._:-]+")
_ID_RULE = "1–{} characters of [A-Za-z0-9._:-]"
_SEQ = re.compile(rb"[0-9]{1,19}")
_SUPERSEDE_VALUES = {b"true": True, b"false": False}
_MAX_SEQ = 2**63 - 1  # a Java long: producers in any language can hold it
# RFC 3339 section 5.6; [0-9] rather than \d, which also matches non-ASCII digits.
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ]([0-9]{2}:[0-9]{2}:[0-9]{2})(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
# W3C Trace Context, version 00 and the forward-compatible form of later versions.
_TRACEPARENT = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?", re.DOTALL
)


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
    seq: Annotated[int, Field(ge=0, le=_MAX_SEQ)] | None = None
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
        if name in _KNOWN_HEADERS:
            if duplicate is None and name in found:
                duplicate = name
            found[name] = raw
    request_id = _request_id(found, duplicate, limits)
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
        payload = _check_value(value, limits) if meta.dataref is None else _no_value(value)
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
        (_SPECVERSION_H, _SPECVERSION_RAW),
        (_ID_H, _utf8(request_id)),
        (_TYPE_H, _REQUEST_TYPE_RAW),
        (_SOURCE_H, _utf8(source)),
        (_CONTENT_TYPE_H, _utf8(str(content_type))),
    ]
    if time is not None:
        headers.append((_TIME_H, _format_time(_TIME_H, time)))
    if deadline is not None:
        headers.append((_DEADLINE_H, _format_time(_DEADLINE_H, deadline)))
    if reply_to is not None:
        headers.append((_REPLYTO_H, _utf8(reply_to)))
    if params:
        headers.append((_PARAMS_H, _dump_params(params)))
    if stream is not None:
        headers.append((_STREAM_H, _utf8(stream)))
    if seq is not None:
        headers.append((_SEQ_H, str(seq).encode()))
    if supersede is not None:
        headers.append((_SUPERSEDE_H, b"true" if supersede else b"false"))
    if traceparent is not None:
        headers.append((_TRACEPARENT_H, _utf8(traceparent)))
    if dataref is not None:
        headers.append((_DATAREF_H, _utf8(dataref)))
    if dataexpires is not None:
        headers.append((_DATAEXPIRES_H, _format_time(_DATAEXPIRES_H, dataexpires)))
    key = _utf8(stream if stream is not None else request_id)
    decoded = decode_request(headers, key, payload, 0, limits)
    if traceparent is not None and decoded.meta.traceparent is None:
        # The decoder ignores a malformed traceparent (W3C says so); a producer
        # that passes one explicitly wants to hear about it.
        raise ContractError(
            ErrorCode.bad_request,
            _TRACEPARENT_H,
            "is not a W3C trace context (version-traceid-parentid-flags, lowercase hex)",
            seen=traceparent,
            request_id=decoded.meta.id,
        )
    return OutgoingRecord(key, payload, headers)


def _request_id(found: Mapping[str, bytes | None], duplicate: str | None, limits: Limits) -> str:
    """The request id, checked before anything else so later errors can carry it."""
    name = _ID_H
    if duplicate == name:
        raise ContractError(
            ErrorCode.bad_request, name, "header appears more than once; send it once"
        )
    if name not in found:
        raise ContractError(ErrorCode.bad_request, name, "required header is missing")
    raw = found[name]
    if raw is None:
        raise ContractError(ErrorCode.bad_request, name, "header has no value (null)")
    if len(raw) > limits.max_id_length or _ID_CHARS.fullmatch(raw) is None:
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "a request id is " + _ID_RULE.format(limits.max_id_length),
            seen=raw,
        )
    return raw.decode("ascii")


def _decode_meta(
    found: Mapping[str, bytes | None], request_id: str, timestamp_ms: int, limits: Limits
) -> RequestMeta:
    _expect(found, _SPECVERSION_H, _SPECVERSION_RAW)
    _expect(found, _TYPE_H, _REQUEST_TYPE_RAW)
    content_type = _content_type(found, limits)
    source = _required_text(found, _SOURCE_H, limits.max_header_value_bytes)
    if not source:
        raise ContractError(ErrorCode.bad_request, _SOURCE_H, "must not be empty")
    fields: dict[str, Any] = {
        "id": request_id,
        "specversion": SPECVERSION,
        "type": REQUEST_TYPE,
        "source": source,
        "time": None,
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
    if len(found) > _REQUIRED_COUNT:
        _read_optional(found, fields, limits)
    return _trusted_meta(fields)


def _read_optional(
    found: Mapping[str, bytes | None], fields: dict[str, Any], limits: Limits
) -> None:
    fields["time"] = _time(found, _TIME_H, limits)
    fields["deadline"] = _time(found, _DEADLINE_H, limits)
    fields["reply_to"] = _reply_to(found, limits)
    fields["params"] = _params(found, limits)
    fields["stream"], fields["seq"] = _stream(found, limits)
    fields["supersede"] = _supersede(found, fields["stream"])
    fields["traceparent"] = _traceparent(found, limits)
    fields["dataref"] = _dataref(found, limits)


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


def _check_value(value: bytes | None, limits: Limits) -> bytes:
    if value is None:
        raise ContractError(
            ErrorCode.bad_request,
            "value",
            "the record has no value (a tombstone); send the payload bytes as the value",
        )
    if not value:
        raise ContractError(
            ErrorCode.bad_request, "value", "the record value is empty; send the payload bytes"
        )
    if len(value) > limits.max_payload_bytes:
        raise ContractError(
            ErrorCode.payload_too_large,
            "value",
            "the payload is too large, in bytes",
            limit=limits.max_payload_bytes,
            seen=len(value),
        )
    return value


def _no_value(value: bytes | None) -> bytes:
    """The value of a request with ``ce_dataref``: empty (or null), the payload is elsewhere."""
    if value:
        raise ContractError(
            ErrorCode.bad_request,
            "value",
            "a request with ce_dataref has an empty value; send the payload bytes or a "
            "reference to them, not both",
            seen=f"{len(value)} bytes",
        )
    return b""


def _expect(found: Mapping[str, bytes | None], name: str, expected: bytes) -> None:
    raw = found.get(name)
    if raw == expected:
        return
    if name not in found:
        raise ContractError(ErrorCode.bad_request, name, "required header is missing")
    if raw is None:
        raise ContractError(ErrorCode.bad_request, name, "header has no value (null)")
    raise ContractError(
        ErrorCode.unsupported_type,
        name,
        f"this worker reads {expected.decode()} only",
        seen=raw,
    )


def _required_text(found: Mapping[str, bytes | None], name: str, max_bytes: int) -> str:
    text = _text(found, name, max_bytes)
    if text is None:
        raise ContractError(ErrorCode.bad_request, name, "required header is missing")
    return text


def _text(found: Mapping[str, bytes | None], name: str, max_bytes: int) -> str | None:
    """A header's value as text; None when it is absent."""
    if name not in found:
        return None
    raw = found[name]
    if raw is None:
        raise ContractError(ErrorCode.bad_request, name, "header has no value (null)")
    if len(raw) > max_bytes:
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "header value is too long, in bytes",
            limit=max_bytes,
            seen=len(raw),
        )
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ContractError(
            ErrorCode.bad_request, name, "header value is not valid UTF-8", seen=raw
        ) from None


def _content_type(found: Mapping[str, bytes | None], limits: Limits) -> ContentType:
    raw = found.get(_CONTENT_TYPE_H)
    if raw is not None and (known := _MEDIA_TYPES_RAW.get(raw)) is not None:
        return known
    text = _required_text(found, _CONTENT_TYPE_H, limits.max_header_value_bytes)
    # Media types are case-insensitive and may carry parameters (RFC 9110 8.3.1).
    media = text.partition(";")[0].strip().lower()
    content_type = _MEDIA_TYPES.get(media)
    if content_type is None:
        raise ContractError(
            ErrorCode.unsupported_media_type,
            _CONTENT_TYPE_H,
            "must be one of " + ", ".join(_MEDIA_TYPES),
            seen=text,
        )
    return content_type


def _time(found: Mapping[str, bytes | None], name: str, limits: Limits) -> datetime | None:
    text = _text(found, name, limits.max_header_value_bytes)
    if text is None:
        return None
    match = _RFC3339.fullmatch(text)
    if match is not None:
        date, clock, fraction, zone = match.groups()
        # fromisoformat reads neither lowercase t/z nor more than six fraction digits.
        zone = "+00:00" if zone in ("Z", "z") else zone
        try:
            parsed = datetime.fromisoformat(f"{date}T{clock}{(fraction or '')[:7]}{zone}")
            return parsed.astimezone(UTC)
        except (ValueError, OverflowError):
            pass  # a well-formed but impossible time, such as February 30th
    raise ContractError(
        ErrorCode.bad_request,
        name,
        "must be an RFC 3339 date and time with an offset, like 2025-01-31T12:00:00.5Z",
        seen=text,
    )


def _reply_to(found: Mapping[str, bytes | None], limits: Limits) -> str | None:
    name = _REPLYTO_H
    text = _text(found, name, limits.max_header_value_bytes)
    if text is not None and not is_valid_topic(text):
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "must be a Kafka topic name: 1–249 characters of [A-Za-z0-9._-]",
            seen=text,
        )
    return text


def _params(found: Mapping[str, bytes | None], limits: Limits) -> dict[str, Any]:
    name = _PARAMS_H
    if name not in found:
        return {}
    raw = found[name]
    if raw is None:
        raise ContractError(ErrorCode.bad_request, name, "header has no value (null)")
    if len(raw) > limits.max_params_bytes:
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "parameters are too large, in bytes",
            limit=limits.max_params_bytes,
            seen=len(raw),
        )
    try:
        params = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ContractError(
            ErrorCode.bad_request, name, f"is not valid UTF-8 JSON: {exc}", seen=raw
        ) from None
    if not isinstance(params, dict):
        raise ContractError(ErrorCode.bad_request, name, "must be a JSON object", seen=raw)
    if _too_deep(params, limits.max_params_depth):
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "objects and arrays are nested too deeply",
            limit=limits.max_params_depth,
        )
    return params


def _too_deep(value: object, depth_left: int) -> bool:
    """Whether ``value`` nests more containers than ``depth_left``; stops at the limit."""
    children: Iterable[object]
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return False
    if depth_left == 0:
        return True
    return any(_too_deep(child, depth_left - 1) for child in children)


def _stream(found: Mapping[str, bytes | None], limits: Limits) -> tuple[str | None, int | None]:
    stream: str | None = None
    name = _STREAM_H
    if name in found:
        raw = found[name]
        if raw is None or len(raw) > limits.max_id_length or _ID_CHARS.fullmatch(raw) is None:
            raise ContractError(
                ErrorCode.bad_request,
                name,
                "a stream id is " + _ID_RULE.format(limits.max_id_length),
                seen=raw,
            )
        stream = raw.decode("ascii")
    name = _SEQ_H
    if name not in found:
        return stream, None
    raw = found[name]
    if raw is None or _SEQ.fullmatch(raw) is None or int(raw) > _MAX_SEQ:
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "must be a non-negative decimal integer below 2**63",
            seen=raw,
        )
    if stream is None:
        raise ContractError(
            ErrorCode.bad_request, name, "needs ce_stream: a sequence number is per stream"
        )
    return stream, int(raw)


def _supersede(found: Mapping[str, bytes | None], stream: str | None) -> bool | None:
    name = _SUPERSEDE_H
    if name not in found:
        return None
    raw = found[name]
    supersede = None if raw is None else _SUPERSEDE_VALUES.get(raw)
    if supersede is None:
        raise ContractError(ErrorCode.bad_request, name, "must be true or false", seen=raw)
    if stream is None:
        raise ContractError(
            ErrorCode.bad_request, name, "needs ce_stream: frames supersede within a stream"
        )
    return supersede


def _traceparent(found: Mapping[str, bytes | None], limits: Limits) -> str | None:
    """The trace context, or None when it is absent or malformed.

    W3C Trace Context says a malformed traceparent must not fail the request:
    the receiver starts a new trace instead, so it is dropped rather than refused.
    """
    raw = found.get(_TRACEPARENT_H)
    if raw is None or len(raw) > limits.max_header_value_bytes:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    match = _TRACEPARENT.fullmatch(text)
    if match is None:
        return None
    version, trace_id, parent_id, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return text


def _dataref(found: Mapping[str, bytes | None], limits: Limits) -> DataRef | None:
    expires = _time(found, _DATAEXPIRES_H, limits)
    text = _text(found, _DATAREF_H, limits.max_header_value_bytes)
    if text is None:
        if expires is not None:
            raise ContractError(
                ErrorCode.bad_request,
                _DATAEXPIRES_H,
                "needs ce_dataref: it says when the referenced payload stops being kept",
            )
        return None
    try:
        ref = parse_dataref(text)
    except ValueError as exc:
        raise ContractError(ErrorCode.bad_request, _DATAREF_H, str(exc), seen=text) from None
    return ref if expires is None else ref._replace(expires=expires)


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
            ErrorCode.bad_request, _PARAMS_H, f"cannot be written as JSON: {exc}"
        ) from None
