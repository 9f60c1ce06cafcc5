"""The contract's codecs on a worker's hot path: one strict header parse per record,
one result encoder per worker.

Both are equal to the full codecs by property tests (tests/unit/test_fastpath.py):

- ``parse_request`` accepts a subset of what ``decode_request`` accepts, with the
  same meaning, and returns ``None`` for everything else (also for valid but unusual
  records, such as a content type with parameters): the caller then runs
  ``decode_request``, which either accepts the record or raises the precise error.
  It builds no pydantic model and no intermediate dict for a typical request.
- ``ResultEncoder`` writes result documents that ``decode_result`` reads back as
  the ``Result`` the pydantic path (``encode_result``) would have written, without
  validating a model per result; the worker builds every value it passes.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import orjson

from schemas.dataref import DataRef
from schemas.errors import ContractError, ErrorCode
from schemas.headers import (
    CAPTURETIME_H,
    CONTENT_TYPE_H,
    DATAEXPIRES_H,
    DATAREF_H,
    DEADLINE_H,
    ID_CHARS,
    ID_H,
    KNOWN_HEADERS,
    MEDIA_TYPES_RAW,
    PARAMS_H,
    REQUEST_TYPE_RAW,
    SOURCE_H,
    SPECVERSION_H,
    SPECVERSION_RAW,
    TIME_H,
    TYPE_H,
    ContentType,
    read_params,
    read_reply_to,
    read_stream,
    read_supersede,
    read_time,
    read_traceparent,
)
from schemas.limits import Limits
from schemas.result import _JSON_RAW, _RESULT_TYPE_RAW, Status

__all__ = ["FastMeta", "ResultEncoder", "parse_request"]

_REQUIRED = (SPECVERSION_H, ID_H, TYPE_H, SOURCE_H, CONTENT_TYPE_H)


class FastMeta(NamedTuple):
    """What a worker needs of a request's headers (``RequestMeta`` has the same fields)."""

    id: str
    content_type: ContentType
    params: dict[str, Any]
    deadline: datetime | None
    reply_to: str | None
    stream: str | None
    seq: int | None
    traceparent: str | None
    supersede: bool | None = None  # ce_supersede; None when absent: the worker's setting decides
    dataref: DataRef | None = None
    """Never set by ``parse_request``: records with ``ce_dataref`` take the full decoder."""


_NO_PARAMS: dict[str, Any] = {}  # shared, never mutated: handlers read params only


def parse_request(
    headers: Sequence[tuple[str, bytes | None]], value: bytes | None, limits: Limits
) -> FastMeta | None:
    """The request's metadata when the record is a plainly valid v1 request, else None.

    None means "ask ``decode_request``": the record may still be valid (it decides) or
    is invalid (it raises the ``ContractError`` that names the problem).
    """
    found = _known_headers(headers, limits)
    if found is None or not _value_ok(value, limits):
        return None
    request_id = found.get(ID_H)
    content_type = MEDIA_TYPES_RAW.get(found.get(CONTENT_TYPE_H, b""))
    if (
        request_id is None
        or content_type is None
        or found.get(SPECVERSION_H) != SPECVERSION_RAW
        or found.get(TYPE_H) != REQUEST_TYPE_RAW
        or len(request_id) > limits.max_id_length
        or ID_CHARS.fullmatch(request_id) is None
        or not _source_ok(found.get(SOURCE_H), limits)
    ):
        return None
    if len(found) == len(_REQUIRED):
        return FastMeta(request_id.decode(), content_type, _NO_PARAMS, *_NONE_6)
    return _with_optional(request_id.decode(), content_type, found, limits)


def _known_headers(
    headers: Sequence[tuple[str, bytes | None]], limits: Limits
) -> dict[str, bytes] | None:
    """The contract's headers by name; None for a null or repeated one, or too many bytes."""
    found: dict[str, bytes] = {}
    total = 0
    for name, raw in headers:
        if raw is None:
            return None
        total += len(name) + len(raw)
        if name in KNOWN_HEADERS:
            if name in found:
                return None
            found[name] = raw
    return found if total <= limits.max_headers_total_bytes else None


def _value_ok(value: bytes | None, limits: Limits) -> bool:
    return value is not None and 0 < len(value) <= limits.max_payload_bytes


def _source_ok(source: bytes | None, limits: Limits) -> bool:
    if not source or len(source) > limits.max_header_value_bytes:
        return False
    try:
        source.decode()
    except UnicodeDecodeError:
        return False
    return True


_NONE_6 = (None, None, None, None, None, None)


def _with_optional(
    request_id: str, content_type: ContentType, found: Mapping[str, bytes], limits: Limits
) -> FastMeta | None:
    """The optional headers, read with the full decoder's own checks."""
    if DATAREF_H in found or DATAEXPIRES_H in found:
        return None  # payload by reference: rare, and its value rules differ
    try:
        # Checked, not kept: workers use neither ce_time nor ce_capturetime.
        read_time(found, TIME_H, limits)
        read_time(found, CAPTURETIME_H, limits)
        deadline = read_time(found, DEADLINE_H, limits)
        reply_to = read_reply_to(found, limits)
        params = read_params(found, limits) if PARAMS_H in found else _NO_PARAMS
        stream, seq = read_stream(found, limits)
        supersede = read_supersede(found, stream)
    except ContractError:
        return None
    return FastMeta(
        request_id,
        content_type,
        params,
        deadline,
        reply_to,
        stream,
        seq,
        read_traceparent(found, limits),
        supersede,
    )


class ResultEncoder:
    """Result documents of one worker (its model, version and id), without pydantic.

    The documents have the fields of ``Result`` in its order. ``outputs`` must be
    JSON-able (NumPy arrays and scalars are written as lists and numbers); anything
    else raises ``ContractError(internal)``, as ``encode_result`` does.
    """

    def __init__(self, model: str, model_version: str, worker: str) -> None:
        self._model = model
        self._version = model_version
        self._worker = worker
        source = f"/conveyor/{model}/{worker}".encode(errors="replace")
        self._header_prefix: list[tuple[str, bytes]] = [
            ("ce_specversion", SPECVERSION_RAW),
            ("ce_type", _RESULT_TYPE_RAW),
            ("ce_source", source),
            ("content-type", _JSON_RAW),
        ]
        # Result event ids: a random per-process prefix and a counter. Unique like a
        # uuid4 per event, at a fraction of its cost.
        self._event_prefix = secrets.token_hex(8) + "-"
        self._events = itertools.count()

    def encode(
        self,
        request_id: str,
        status: Status,
        outputs: Any,
        error: tuple[str, str] | None,
        timings: Mapping[str, Any] | None,
        attempt: int = 1,
    ) -> bytes:
        """One result document. ``error`` is ``(code, message)``, None for ``ok``."""
        document = {
            "id": request_id,
            "status": status.value,
            "model": self._model,
            "model_version": self._version,
            "outputs": outputs,
            "error": None if error is None else {"code": error[0], "message": error[1]},
            "timings": timings,
            "worker": self._worker,
            "attempt": attempt,
        }
        try:
            return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:
            raise ContractError(
                ErrorCode.internal,
                "outputs",
                f"cannot be written as JSON: {exc}",
                request_id=request_id,
            ) from None

    def headers(self, request_id: str, traceparent: str | None) -> list[tuple[str, bytes]]:
        """CloudEvents headers of the result record on the reply topic (``result_headers``)."""
        headers = [
            *self._header_prefix,
            ("ce_id", f"{self._event_prefix}{next(self._events)}".encode()),
            ("ce_subject", request_id.encode()),
        ]
        if traceparent is not None:
            headers.append(("traceparent", traceparent.encode()))
        return headers
