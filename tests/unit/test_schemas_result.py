"""Result documents, reply-topic headers, names and dead-letter headers."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from schemas import (
    ContractError,
    ErrorCode,
    ErrorInfo,
    Result,
    Status,
    Timings,
    consumer_group,
    decode_result,
    dlq_headers,
    encode_result,
    error_result,
    ok_result,
    result_headers,
    result_key,
    status_for,
    topics_for,
)
from schemas.dlq import MAX_MESSAGE_BYTES

TIMINGS = Timings(
    produced_ms=1_700_000_000_000,
    received_ms=1_700_000_000_001.5,
    batch_start_ms=1_700_000_000_002.0,
    finished_ms=1_700_000_000_010.0,
    queue_ms=2.0,
    inference_ms=8.0,
    batch_size=4,
)
OUTPUTS = [{"label": "7", "index": 7, "score": 0.98}]


def ok() -> Result:
    return ok_result(
        "id1", OUTPUTS, model="digits", model_version="1", worker="w1", timings=TIMINGS
    )


def test_ok_result_document_has_every_field() -> None:
    document = orjson.loads(encode_result(ok()))
    assert document == {
        "id": "id1",
        "status": "ok",
        "model": "digits",
        "model_version": "1",
        "outputs": OUTPUTS,
        "error": None,
        "timings": TIMINGS.model_dump(),
        "worker": "w1",
        "attempt": 1,
    }


def test_status_ok_if_and_only_if_error_is_null() -> None:
    info = ErrorInfo(code=ErrorCode.model_error, message="boom")
    common = {"id": "id1", "model": "m", "model_version": "1", "worker": "w"}
    with pytest.raises(ValidationError, match="ok result has no error"):
        Result(status=Status.ok, error=info, **common)
    for status in (Status.error, Status.expired, Status.rejected):
        with pytest.raises(ValidationError, match="needs an error"):
            Result(status=status, **common)
        with pytest.raises(ValidationError, match="has no outputs"):
            Result(status=status, error=info, outputs=[1], **common)
    with pytest.raises(ValidationError):
        Result(status=Status.ok, attempt=0, **common)
    with pytest.raises(ValidationError):
        Result(status=Status.ok, **{**common, "id": "bad id"})


def test_error_result_and_status_for() -> None:
    result = error_result(
        "id1",
        ErrorCode.payload_too_large,
        "value: too large",
        model="m",
        model_version="1",
        worker="w",
        status=status_for(ErrorCode.payload_too_large),
    )
    assert (result.status, result.outputs, result.timings) == (Status.error, None, None)
    assert result.error == ErrorInfo(code=ErrorCode.payload_too_large, message="value: too large")
    assert status_for(ErrorCode.expired) is Status.expired
    assert status_for(ErrorCode.decode_failed) is Status.error
    assert status_for(ErrorCode.unsupported_type) is Status.rejected
    assert status_for("from_the_future") is Status.error


def test_readers_ignore_unknown_fields_and_keep_unknown_codes() -> None:
    document = orjson.loads(encode_result(ok()))
    document["added_in_v2"] = {"anything": [1, 2]}
    assert decode_result(orjson.dumps(document)) == ok()
    failed = {
        "id": "id1",
        "status": "error",
        "model": "m",
        "model_version": "1",
        "error": {"code": "quota_exceeded", "message": "later", "hint": "new field"},
        "worker": "w",
    }
    result = decode_result(orjson.dumps(failed))
    assert result.error is not None
    assert result.error.code == "quota_exceeded"
    assert not isinstance(result.error.code, ErrorCode)
    failed["error"] = {"code": "expired", "message": "late"}
    known = decode_result(orjson.dumps(failed)).error
    assert known is not None
    assert known.code is ErrorCode.expired


@pytest.mark.parametrize(
    ("data", "field", "request_id"),
    [
        (b"", "result", None),
        (b"\xff", "result", None),
        (b"[1]", "result", None),
        (
            b'{"id": "id1", "status": "ok", "model": "m", "worker": "w"}',
            "result.model_version",
            "id1",
        ),
        (b'{"id": "id1", "status": "done"}', "result.status", "id1"),
        (b'{"id": "a b", "status": "ok"}', "result.id", None),
    ],
)
def test_garbage_results_raise_contract_error(
    data: bytes, field: str, request_id: str | None
) -> None:
    with pytest.raises(ContractError) as info:
        decode_result(data)
    assert (info.value.code, info.value.field, info.value.request_id) == (
        ErrorCode.decode_failed,
        field,
        request_id,
    )


def test_outputs_that_are_not_json_raise_contract_error() -> None:
    result = ok_result("id1", {"x": object()}, model="m", model_version="1", worker="w")
    with pytest.raises(ContractError) as info:
        encode_result(result)
    assert (info.value.code, info.value.field, info.value.request_id) == (
        ErrorCode.internal,
        "outputs",
        "id1",
    )


def test_result_headers() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    first = dict(result_headers(ok(), traceparent=tp))
    second = dict(result_headers(ok()))
    assert first["ce_specversion"] == b"1.0"
    assert first["ce_type"] == b"conveyor.result.v1"
    assert first["ce_subject"] == b"id1"
    assert first["content-type"] == b"application/json"
    assert first["ce_source"] == b"/conveyor/digits/w1"
    assert first["traceparent"] == tp.encode()
    assert "traceparent" not in second
    assert first["ce_id"] != second["ce_id"]


def test_topic_and_key_names() -> None:
    topics = topics_for("digits")
    assert (topics.requests, topics.results, topics.dlq) == (
        "conveyor.digits.requests",
        "conveyor.digits.results",
        "conveyor.digits.dlq",
    )
    assert topics_for("m", prefix="team-a").dlq == "team-a.m.dlq"
    assert consumer_group("digits") == "conveyor.digits"
    assert result_key("id1") == "conveyor:result:id1"
    assert result_key("id1", prefix="test:") == "test:id1"
    for bad in ("", "a b", "a/b", "ü"):
        with pytest.raises(ValueError, match="Kafka topic name"):
            topics_for(bad)
        with pytest.raises(ValueError, match="Kafka topic name"):
            consumer_group(bad)
    with pytest.raises(ValueError, match="too long"):
        topics_for("m" * 240)
    with pytest.raises(ContractError):
        result_key("a b")


def test_dlq_headers_keep_the_original_and_add_the_reason() -> None:
    original: list[tuple[str, bytes | None]] = [
        ("ce_id", b"\xff"),
        ("null", None),
        ("conveyor_error_code", b"stale"),
    ]
    headers = dlq_headers(
        original,
        code=ErrorCode.bad_request,
        message="ce_id: a request id is 1–128 characters",
        field="ce_id",
        source_topic="conveyor.digits.requests",
        partition=2,
        offset=41,
        worker="host:123",
    )
    assert headers == [
        ("ce_id", b"\xff"),
        ("null", None),
        ("conveyor_error_code", b"bad_request"),
        ("conveyor_error_message", "ce_id: a request id is 1–128 characters".encode()),
        ("conveyor_error_field", b"ce_id"),
        ("conveyor_source_topic", b"conveyor.digits.requests"),
        ("conveyor_source_partition", b"2"),
        ("conveyor_source_offset", b"41"),
        ("conveyor_worker", b"host:123"),
    ]
    long = dlq_headers(
        [],
        code=ErrorCode.internal,
        message="é" * 2000,
        field=None,
        source_topic="t",
        partition=0,
        offset=0,
        worker="w",
    )
    names = [name for name, _ in long]
    assert "conveyor_error_field" not in names
    message = dict(long)["conveyor_error_message"]
    assert message is not None
    assert len(message) <= MAX_MESSAGE_BYTES
    assert message.decode().endswith("…")
