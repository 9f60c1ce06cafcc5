"""Request records: each rule of the contract, one case at a time."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from schemas import (
    DEFAULT_LIMITS,
    ContentType,
    ContractError,
    ErrorCode,
    Limits,
    RequestMeta,
    decode_request,
    encode_request,
    new_request_id,
)
from schemas.request import _trusted_meta

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PAYLOAD = b"\x89PNG fake image bytes"
# Unset means "leave the header out".
UNSET: Any = object()


def headers(**values: Any) -> list[tuple[str, bytes | None]]:
    """Valid minimal request headers; keyword values override or (UNSET) drop one.

    Keywords use the header name with '-' written as '_' (content_type).
    """
    base: dict[str, bytes | None] = {
        "ce_specversion": b"1.0",
        "ce_id": b"req-1",
        "ce_type": b"conveyor.request.v1",
        "ce_source": b"unit-test",
        "content-type": b"image/png",
    }
    for keyword, value in values.items():
        name = "content-type" if keyword == "content_type" else keyword
        if value is UNSET:
            base.pop(name, None)
        else:
            base[name] = value.encode() if isinstance(value, str) else value
    return list(base.items())


def decode(hdrs: list[tuple[str, bytes | None]], value: bytes | None = PAYLOAD) -> Any:
    return decode_request(hdrs, b"key", value, 1_700_000_000_000)


def refused(hdrs: list[tuple[str, bytes | None]], value: bytes | None = PAYLOAD) -> ContractError:
    with pytest.raises(ContractError) as info:
        decode(hdrs, value)
    return info.value


def test_minimal_request_decodes_without_copying_the_payload() -> None:
    value = bytes(PAYLOAD)
    request = decode(headers(), value)
    assert request.payload is value
    meta = request.meta
    assert (meta.id, meta.source, meta.content_type) == ("req-1", "unit-test", ContentType.PNG)
    assert (meta.specversion, meta.type) == ("1.0", "conveyor.request.v1")
    assert meta.timestamp_ms == 1_700_000_000_000
    assert meta.params == {}
    assert meta.time is meta.deadline is meta.reply_to is meta.stream is meta.seq is None
    assert meta.supersede is None
    assert meta.capture_time is None


def test_all_optional_headers_decode() -> None:
    request = decode(
        headers(
            ce_time="2025-01-31T12:00:00.5Z",
            ce_capturetime="2025-01-31T12:59:59.96+01:00",
            ce_deadline="2025-01-31t13:00:00.1234567+01:00",
            ce_replyto="my.replies",
            ce_params='{"top_k": 5, "labels": ["a"]}',
            ce_stream="cam-1",
            ce_seq="42",
            ce_supersede="true",
            traceparent=TRACEPARENT,
        )
    )
    meta = request.meta
    assert meta.time == datetime(2025, 1, 31, 12, 0, 0, 500000, tzinfo=UTC)
    assert meta.capture_time == datetime(2025, 1, 31, 11, 59, 59, 960000, tzinfo=UTC)
    # Converted to UTC; digits past microseconds are dropped.
    assert meta.deadline == datetime(2025, 1, 31, 12, 0, 0, 123456, tzinfo=UTC)
    assert meta.deadline is not None
    assert meta.deadline.tzinfo is UTC
    assert meta.reply_to == "my.replies"
    assert meta.params == {"top_k": 5, "labels": ["a"]}
    assert (meta.stream, meta.seq, meta.traceparent) == ("cam-1", 42, TRACEPARENT)
    assert meta.supersede is True
    assert decode(headers(ce_stream="s", ce_supersede="false")).meta.supersede is False


def test_trusted_construction_matches_model_construct() -> None:
    fields = decode(headers(ce_params='{"a": 1}', ce_stream="s", ce_seq="1")).meta.model_dump()
    built = _trusted_meta(dict(fields))
    reference = RequestMeta.model_construct(**fields)
    assert built == reference
    assert built.model_fields_set == reference.model_fields_set
    assert RequestMeta.model_validate(built.model_dump()) == built
    assert built.model_dump_json() == reference.model_dump_json()
    with pytest.raises(ValueError, match="frozen"):
        built.id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("image/png; charset=utf-8", ContentType.PNG),
        ("IMAGE/JPEG", ContentType.JPEG),
        (" application/x-npy ", ContentType.NPY),
        ("text/plain;charset=utf-8", ContentType.TEXT),
    ],
)
def test_content_type_tolerates_case_and_parameters(value: str, expected: ContentType) -> None:
    assert decode(headers(content_type=value)).meta.content_type is expected


# (headers, code, field): every error that still knows the request id.
WITH_ID = [
    (headers(ce_specversion=UNSET), ErrorCode.bad_request, "ce_specversion"),
    (headers(ce_specversion="0.3"), ErrorCode.unsupported_type, "ce_specversion"),
    (headers(ce_specversion=None), ErrorCode.bad_request, "ce_specversion"),
    (headers(ce_type="conveyor.request.v2"), ErrorCode.unsupported_type, "ce_type"),
    (headers(ce_type=UNSET), ErrorCode.bad_request, "ce_type"),
    (headers(ce_source=UNSET), ErrorCode.bad_request, "ce_source"),
    (headers(ce_source=""), ErrorCode.bad_request, "ce_source"),
    (headers(ce_source=None), ErrorCode.bad_request, "ce_source"),
    (headers(ce_source=b"\xff\xfe"), ErrorCode.bad_request, "ce_source"),
    (headers(ce_source="x" * 1025), ErrorCode.bad_request, "ce_source"),
    (headers(content_type=UNSET), ErrorCode.bad_request, "content-type"),
    (headers(content_type="image/gif"), ErrorCode.unsupported_media_type, "content-type"),
    (headers(ce_time="2025-01-31"), ErrorCode.bad_request, "ce_time"),
    (headers(ce_capturetime="1738324800"), ErrorCode.bad_request, "ce_capturetime"),
    (headers(ce_capturetime=None), ErrorCode.bad_request, "ce_capturetime"),
    (headers(ce_deadline="2025-01-31T12:00:00"), ErrorCode.bad_request, "ce_deadline"),
    (headers(ce_deadline="20250131T120000Z"), ErrorCode.bad_request, "ce_deadline"),
    (headers(ce_deadline="2025-02-30T12:00:00Z"), ErrorCode.bad_request, "ce_deadline"),
    (headers(ce_deadline="0001-01-01T00:00:00+01:00"), ErrorCode.bad_request, "ce_deadline"),
    (headers(ce_deadline="٢٠٢٥-01-31T12:00:00Z"), ErrorCode.bad_request, "ce_deadline"),
    (headers(ce_replyto="no spaces"), ErrorCode.bad_request, "ce_replyto"),
    (headers(ce_replyto=".."), ErrorCode.bad_request, "ce_replyto"),
    (headers(ce_params="[1]"), ErrorCode.bad_request, "ce_params"),
    (headers(ce_params="{bad json"), ErrorCode.bad_request, "ce_params"),
    (headers(ce_params=b'{"a": "\xff"}'), ErrorCode.bad_request, "ce_params"),
    (headers(ce_params='{"a": NaN}'), ErrorCode.bad_request, "ce_params"),
    (headers(ce_params='{"a":' + "[" * 8 + "]" * 8 + "}"), ErrorCode.bad_request, "ce_params"),
    (headers(ce_params='{"a": "' + "x" * 16400 + '"}'), ErrorCode.bad_request, "ce_params"),
    (headers(ce_stream="has space"), ErrorCode.bad_request, "ce_stream"),
    (headers(ce_stream="s", ce_seq="-1"), ErrorCode.bad_request, "ce_seq"),
    (headers(ce_stream="s", ce_seq="+1"), ErrorCode.bad_request, "ce_seq"),
    (headers(ce_stream="s", ce_seq=str(2**63)), ErrorCode.bad_request, "ce_seq"),
    (headers(ce_seq="1"), ErrorCode.bad_request, "ce_seq"),
    (headers(ce_stream="s", ce_supersede="yes"), ErrorCode.bad_request, "ce_supersede"),
    (headers(ce_stream="s", ce_supersede="True"), ErrorCode.bad_request, "ce_supersede"),
    (headers(ce_supersede="true"), ErrorCode.bad_request, "ce_supersede"),
    ([*headers(), ("ce_source", b"again")], ErrorCode.bad_request, "ce_source"),
    ([*headers(), ("x-big", b"x" * 70_000)], ErrorCode.bad_request, "headers"),
]


@pytest.mark.parametrize(("hdrs", "code", "field"), WITH_ID)
def test_errors_after_the_id_carry_it(
    hdrs: list[tuple[str, bytes | None]], code: ErrorCode, field: str
) -> None:
    err = refused(hdrs)
    assert (err.code, err.field, err.request_id) == (code, field, "req-1")
    assert str(err).startswith(f"{field}: ")


def test_params_depth_limit_is_inclusive() -> None:
    seven_more = '{"a":' + "[" * 7 + "]" * 7 + "}"
    assert decode(headers(ce_params=seven_more)).meta.params == {"a": [[[[[[[]]]]]]]}


@pytest.mark.parametrize(
    "hdrs",
    [
        headers(ce_id=UNSET),
        headers(ce_id=None),
        headers(ce_id=""),
        headers(ce_id="has space"),
        headers(ce_id="x" * 129),
        headers(ce_id="é"),
        headers(ce_id=b"\xff"),
        [*headers(), ("ce_id", b"req-1")],
    ],
)
def test_records_without_a_usable_id_have_no_request_id(
    hdrs: list[tuple[str, bytes | None]],
) -> None:
    err = refused(hdrs)
    assert (err.code, err.field, err.request_id) == (ErrorCode.bad_request, "ce_id", None)


def test_id_of_128_characters_is_accepted() -> None:
    assert decode(headers(ce_id="a" * 128)).meta.id == "a" * 128


def test_tombstone_and_empty_value_are_bad_requests() -> None:
    for value in (None, b""):
        err = refused(headers(), value)
        assert (err.code, err.field, err.request_id) == (ErrorCode.bad_request, "value", "req-1")


def test_payload_over_the_limit_names_limit_and_size() -> None:
    limits = Limits(max_payload_bytes=10)
    with pytest.raises(ContractError) as info:
        decode_request(headers(), None, b"x" * 11, 0, limits)
    err = info.value
    assert (err.code, err.limit, err.seen, err.request_id) == (
        ErrorCode.payload_too_large,
        10,
        11,
        "req-1",
    )
    assert "limit 10" in str(err)
    assert "got 11" in str(err)
    assert decode_request(headers(), None, b"x" * 10, 0, limits).payload == b"x" * 10


def test_header_names_match_exactly_and_unknown_headers_are_ignored() -> None:
    hdrs = [("CE_ID", b"other"), ("x-custom", b"\xff\x00"), ("empty", None), *headers()]
    assert decode(hdrs).meta.id == "req-1"
    err = refused([("Content-Type", b"image/png"), *headers(content_type=UNSET)])
    assert err.field == "content-type"


@pytest.mark.parametrize(
    "value",
    [
        "not-a-trace",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    ],
)
def test_malformed_traceparent_is_dropped_not_refused(value: str) -> None:
    assert decode(headers(traceparent=value)).meta.traceparent is None


def test_later_traceparent_version_is_kept() -> None:
    value = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-more"
    assert decode(headers(traceparent=value)).meta.traceparent == value


def test_error_message_quotes_safely_and_truncates() -> None:
    err = refused(headers(content_type="evil\x1b[31m" + "x" * 200))
    text = str(err)
    assert "\x1b" not in text
    assert "\\x1b" in text
    assert "(209 characters)" in text
    assert len(text) < 300
    err = refused(headers(ce_id=b"\x00" * 500))
    assert "\x00" not in str(err)
    assert "(500 bytes)" in str(err)


def test_contract_error_survives_pickling() -> None:
    err = refused(headers(ce_source=""))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.code, copy.field, copy.request_id, str(copy)) == (
        err.code,
        err.field,
        err.request_id,
        str(err),
    )
    assert not copy.retriable
    assert isinstance(copy, ValueError)


def test_encode_builds_the_documented_record() -> None:
    deadline = datetime(2025, 1, 31, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    record = encode_request(
        PAYLOAD,
        request_id="id1",
        content_type=ContentType.JPEG,
        source="svc",
        params={"top_k": 5},
        deadline=deadline,
        stream="cam-1",
        seq=7,
        traceparent=TRACEPARENT,
        capture_time=datetime(2025, 1, 31, 11, 59, 59, 960000, tzinfo=UTC),
    )
    assert record.key == b"cam-1"
    assert record.value is PAYLOAD
    assert record.headers == [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"id1"),
        ("ce_type", b"conveyor.request.v1"),
        ("ce_source", b"svc"),
        ("content-type", b"image/jpeg"),
        ("ce_capturetime", b"2025-01-31T11:59:59.960000Z"),
        ("ce_deadline", b"2025-01-31T12:00:00Z"),
        ("ce_params", b'{"top_k":5}'),
        ("ce_stream", b"cam-1"),
        ("ce_seq", b"7"),
        ("traceparent", TRACEPARENT.encode()),
    ]
    assert all(type(name) is str for name, _ in record.headers)
    assert encode_request(PAYLOAD, request_id="id2", content_type="text/plain", source="s").key == (
        b"id2"
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": "bad id"}, "ce_id"),
        ({"request_id": "\ud800"}, "ce_id"),
        ({"source": ""}, "ce_source"),
        ({"content_type": "image/gif"}, "content-type"),
        ({"deadline": datetime(2025, 1, 1)}, "ce_deadline"),
        ({"time": datetime.min.replace(tzinfo=timezone(timedelta(hours=1)))}, "ce_time"),
        ({"capture_time": datetime(2025, 1, 31, 12)}, "ce_capturetime"),
        ({"params": {"f": object()}}, "ce_params"),
        ({"params": {"big": 2**64}}, "ce_params"),
        ({"seq": 1}, "ce_seq"),
        ({"stream": "s", "seq": -1}, "ce_seq"),
        ({"supersede": True}, "ce_supersede"),
        ({"traceparent": "nope"}, "traceparent"),
        ({"reply_to": "a/b"}, "ce_replyto"),
    ],
)
def test_encode_refuses_what_a_worker_would_refuse(kwargs: dict[str, Any], field: str) -> None:
    arguments: dict[str, Any] = {
        "request_id": "id1",
        "content_type": ContentType.PNG,
        "source": "svc",
    } | kwargs
    with pytest.raises(ContractError) as info:
        encode_request(PAYLOAD, **arguments)
    assert info.value.field == field


def test_encode_checks_the_payload_limit() -> None:
    with pytest.raises(ContractError) as info:
        encode_request(
            b"xx",
            request_id="a",
            content_type="text/plain",
            source="s",
            limits=Limits(max_payload_bytes=1),
        )
    assert info.value.code is ErrorCode.payload_too_large


def test_new_request_ids_are_valid_and_distinct() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    for request_id in ids:
        assert decode(headers(ce_id=request_id)).meta.id == request_id


def test_default_limits_are_the_published_ones() -> None:
    assert DEFAULT_LIMITS.max_id_length == 128
    assert DEFAULT_LIMITS.max_payload_bytes == 16 * 1024 * 1024
    assert DEFAULT_LIMITS.max_pixels == 40_000_000
    with pytest.raises(ValueError, match="128"):
        Limits(max_id_length=129)
