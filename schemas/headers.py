"""The request headers: their names, and one reader per header that checks its value.

Both decoders of a request record use these: the full one (``schemas.request``)
and the worker's fast path (``schemas.fastpath``), so the two accept exactly the
same headers and refuse the rest with the same ``ContractError``. Each reader
takes the record's known headers by name (``found``) and the limits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import orjson

from schemas.dataref import DataRef, parse_dataref
from schemas.errors import ContractError, ErrorCode
from schemas.limits import Limits
from schemas.naming import is_valid_topic

SPECVERSION = "1.0"
REQUEST_TYPE = "conveyor.request.v1"


class Header(StrEnum):
    """Names of the request headers (matched exactly, case-sensitive)."""

    SPECVERSION = "ce_specversion"
    ID = "ce_id"
    TYPE = "ce_type"
    SOURCE = "ce_source"
    TIME = "ce_time"
    CAPTURETIME = "ce_capturetime"
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
SPECVERSION_H = Header.SPECVERSION.value
ID_H = Header.ID.value
TYPE_H = Header.TYPE.value
SOURCE_H = Header.SOURCE.value
TIME_H = Header.TIME.value
CAPTURETIME_H = Header.CAPTURETIME.value
CONTENT_TYPE_H = Header.CONTENT_TYPE.value
DEADLINE_H = Header.DEADLINE.value
REPLYTO_H = Header.REPLYTO.value
PARAMS_H = Header.PARAMS.value
STREAM_H = Header.STREAM.value
SEQ_H = Header.SEQ.value
SUPERSEDE_H = Header.SUPERSEDE.value
TRACEPARENT_H = Header.TRACEPARENT.value
DATAREF_H = Header.DATAREF.value
DATAEXPIRES_H = Header.DATAEXPIRES.value
KNOWN_HEADERS = frozenset(h.value for h in Header)
REQUIRED_COUNT = 5  # ce_specversion, ce_id, ce_type, ce_source, content-type
_MEDIA_TYPES = {c.value: c for c in ContentType}
# The exact bytes almost every producer sends; the slow path handles case and parameters.
MEDIA_TYPES_RAW = {c.value.encode(): c for c in ContentType}
SPECVERSION_RAW = SPECVERSION.encode()
REQUEST_TYPE_RAW = REQUEST_TYPE.encode()
ID_CHARS = re.compile(rb"[A-Za-z0-9._:-]+")
_ID_RULE = "1–{} characters of [A-Za-z0-9._:-]"
_SEQ = re.compile(rb"[0-9]{1,19}")
_SUPERSEDE_VALUES = {b"true": True, b"false": False}
MAX_SEQ = 2**63 - 1  # a Java long: producers in any language can hold it
# RFC 3339 section 5.6; [0-9] rather than \d, which also matches non-ASCII digits.
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ]([0-9]{2}:[0-9]{2}:[0-9]{2})(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
# W3C Trace Context, version 00 and the forward-compatible form of later versions.
_TRACEPARENT = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?", re.DOTALL
)


def read_request_id(
    found: Mapping[str, bytes | None], duplicate: str | None, limits: Limits
) -> str:
    """The request id, checked before anything else so later errors can carry it."""
    name = ID_H
    if duplicate == name:
        raise ContractError(
            ErrorCode.bad_request, name, "header appears more than once; send it once"
        )
    if name not in found:
        raise ContractError(ErrorCode.bad_request, name, "required header is missing")
    raw = found[name]
    if raw is None:
        raise ContractError(ErrorCode.bad_request, name, "header has no value (null)")
    if len(raw) > limits.max_id_length or ID_CHARS.fullmatch(raw) is None:
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "a request id is " + _ID_RULE.format(limits.max_id_length),
            seen=raw,
        )
    return raw.decode("ascii")


def check_value(value: bytes | None, limits: Limits) -> bytes:
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


def check_no_value(value: bytes | None) -> bytes:
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


def expect(found: Mapping[str, bytes | None], name: str, expected: bytes) -> None:
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


def required_text(found: Mapping[str, bytes | None], name: str, max_bytes: int) -> str:
    text = read_text(found, name, max_bytes)
    if text is None:
        raise ContractError(ErrorCode.bad_request, name, "required header is missing")
    return text


def read_text(found: Mapping[str, bytes | None], name: str, max_bytes: int) -> str | None:
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


def read_content_type(found: Mapping[str, bytes | None], limits: Limits) -> ContentType:
    raw = found.get(CONTENT_TYPE_H)
    if raw is not None and (known := MEDIA_TYPES_RAW.get(raw)) is not None:
        return known
    text = required_text(found, CONTENT_TYPE_H, limits.max_header_value_bytes)
    # Media types are case-insensitive and may carry parameters (RFC 9110 8.3.1).
    media = text.partition(";")[0].strip().lower()
    content_type = _MEDIA_TYPES.get(media)
    if content_type is None:
        raise ContractError(
            ErrorCode.unsupported_media_type,
            CONTENT_TYPE_H,
            "must be one of " + ", ".join(_MEDIA_TYPES),
            seen=text,
        )
    return content_type


def read_time(found: Mapping[str, bytes | None], name: str, limits: Limits) -> datetime | None:
    text = read_text(found, name, limits.max_header_value_bytes)
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


def read_reply_to(found: Mapping[str, bytes | None], limits: Limits) -> str | None:
    name = REPLYTO_H
    text = read_text(found, name, limits.max_header_value_bytes)
    if text is not None and not is_valid_topic(text):
        raise ContractError(
            ErrorCode.bad_request,
            name,
            "must be a Kafka topic name: 1–249 characters of [A-Za-z0-9._-]",
            seen=text,
        )
    return text


def read_params(found: Mapping[str, bytes | None], limits: Limits) -> dict[str, Any]:
    name = PARAMS_H
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


def read_stream(found: Mapping[str, bytes | None], limits: Limits) -> tuple[str | None, int | None]:
    stream: str | None = None
    name = STREAM_H
    if name in found:
        raw = found[name]
        if raw is None or len(raw) > limits.max_id_length or ID_CHARS.fullmatch(raw) is None:
            raise ContractError(
                ErrorCode.bad_request,
                name,
                "a stream id is " + _ID_RULE.format(limits.max_id_length),
                seen=raw,
            )
        stream = raw.decode("ascii")
    name = SEQ_H
    if name not in found:
        return stream, None
    raw = found[name]
    if raw is None or _SEQ.fullmatch(raw) is None or int(raw) > MAX_SEQ:
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


def read_supersede(found: Mapping[str, bytes | None], stream: str | None) -> bool | None:
    name = SUPERSEDE_H
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


def read_traceparent(found: Mapping[str, bytes | None], limits: Limits) -> str | None:
    """The trace context, or None when it is absent or malformed.

    W3C Trace Context says a malformed traceparent must not fail the request:
    the receiver starts a new trace instead, so it is dropped rather than refused.
    """
    raw = found.get(TRACEPARENT_H)
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


def read_dataref(found: Mapping[str, bytes | None], limits: Limits) -> DataRef | None:
    expires = read_time(found, DATAEXPIRES_H, limits)
    text = read_text(found, DATAREF_H, limits.max_header_value_bytes)
    if text is None:
        if expires is not None:
            raise ContractError(
                ErrorCode.bad_request,
                DATAEXPIRES_H,
                "needs ce_dataref: it says when the referenced payload stops being kept",
            )
        return None
    try:
        ref = parse_dataref(text)
    except ValueError as exc:
        raise ContractError(ErrorCode.bad_request, DATAREF_H, str(exc), seen=text) from None
    return ref if expires is None else ref._replace(expires=expires)
