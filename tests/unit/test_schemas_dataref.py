"""The contract's payload by reference: ce_dataref and ce_dataexpires on request records."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import (
    ContentType,
    ContractError,
    DataRef,
    ErrorCode,
    Limits,
    cancel_key,
    decode_request,
    encode_request,
    redis_dataref,
    s3_dataref,
    status_key,
)
from schemas.fastpath import parse_request

BASE = [
    ("ce_specversion", b"1.0"),
    ("ce_id", b"id1"),
    ("ce_type", b"conveyor.request.v1"),
    ("ce_source", b"kcat"),
    ("content-type", b"image/png"),
]


def test_a_reference_with_an_empty_or_null_value_decodes_with_its_expiry() -> None:
    headers = [
        *BASE,
        ("ce_dataref", b"s3://payloads/in/id1.png"),
        ("ce_dataexpires", b"2030-01-31T12:00:00Z"),
    ]
    for value in (b"", None):
        request = decode_request(headers, b"id1", value, 0)
        assert request.payload == b""
        assert request.meta.content_type is ContentType.PNG  # the real payload's type
        assert request.meta.dataref == DataRef(
            "s3://payloads/in/id1.png",
            "s3",
            "payloads",
            "in/id1.png",
            datetime(2030, 1, 31, 12, tzinfo=UTC),
        )
        assert parse_request(headers, value, Limits()) is None  # the full decoder reads it


@pytest.mark.parametrize(
    ("extra", "value", "field"),
    [
        ([("ce_dataref", b"redis:conveyor:data:id1")], b"bytes", "value"),  # both
        ([("ce_dataref", b"ftp://host/x")], b"", "ce_dataref"),
        ([("ce_dataexpires", b"2030-01-31T12:00:00Z")], b"x", "ce_dataexpires"),
        ([("ce_dataref", b"redis:a"), ("ce_dataexpires", b"tomorrow")], b"", "ce_dataexpires"),
        ([("ce_dataref", b"redis:a"), ("ce_dataref", b"redis:b")], b"", "ce_dataref"),
    ],
)
def test_malformed_references_are_bad_requests_with_the_id(
    extra: list[tuple[str, bytes]], value: bytes, field: str
) -> None:
    headers = [*BASE, *extra]
    with pytest.raises(ContractError) as caught:
        decode_request(headers, b"id1", value, 0)
    assert caught.value.code is ErrorCode.bad_request
    assert caught.value.field == field
    assert caught.value.request_id == "id1"
    assert parse_request(headers, value, Limits()) is None


def test_the_sdk_helpers_write_references_the_decoder_reads_back() -> None:
    for uri, key in [
        (redis_dataref("conveyor:data:id1"), "conveyor:data:id1"),
        (redis_dataref("odd key/100%"), "odd key/100%"),
        (s3_dataref("payloads", "a b/ü.png"), "a b/ü.png"),
    ]:
        record = encode_request(
            b"", request_id="id1", content_type=ContentType.PNG, source="t", dataref=uri
        )
        assert record.value == b""
        meta = decode_request(record.headers, record.key, record.value, 0).meta
        assert meta.dataref is not None
        assert meta.dataref.key == key
    assert redis_dataref("conveyor:data:id1") == "redis:conveyor:data:id1"


def test_cancel_and_status_keys_share_the_request_ids_hash_tag() -> None:
    assert cancel_key("id1") == "conveyor:cancel:{id1}"
    assert status_key("id1") == "conveyor:status:{id1}"
    with pytest.raises(ContractError):
        cancel_key("no spaces")
