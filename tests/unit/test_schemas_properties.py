"""Property tests: any bytes at all only ever raise ContractError, and encode/decode round-trip."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from hypothesis import event, given
from hypothesis import strategies as st

from schemas import (
    ContentType,
    ContractError,
    ErrorCode,
    ErrorInfo,
    Limits,
    Request,
    RequestMeta,
    Result,
    Status,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    is_valid_request_id,
)
from tests.strategies import (
    aware_datetimes,
    ids,
    json_values,
    params,
    record_headers,
    texts,
    timings,
    topics,
    traceparents,
)


def _decode_or_error(
    headers: list[tuple[str, bytes | None]],
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
    limits: Limits,
) -> Request | ContractError:
    """The request, or the ContractError; any other exception fails the test."""
    try:
        return decode_request(headers, key, value, timestamp_ms, limits)
    except ContractError as err:
        return err


@given(
    headers=record_headers(),
    key=st.none() | st.binary(max_size=20),
    value=st.none() | st.binary(max_size=40),
    timestamp_ms=st.integers(),
    max_payload=st.integers(min_value=1, max_value=50),
)
def test_any_record_decodes_or_raises_contract_error(
    headers: list[tuple[str, bytes | None]],
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
    max_payload: int,
) -> None:
    limits = Limits(max_payload_bytes=max_payload)
    outcome = _decode_or_error(headers, key, value, timestamp_ms, limits)
    if isinstance(outcome, ContractError):
        event(f"refused: {outcome.field}")  # pytest --hypothesis-show-statistics shows the spread
        assert isinstance(outcome.code, ErrorCode)
        assert outcome.request_id is None or is_valid_request_id(outcome.request_id)
        assert str(outcome).startswith(outcome.field)
    else:
        event("decoded")
        assert outcome.payload is value
        # What the decoder built without validation passes pydantic's validation.
        assert RequestMeta.model_validate(outcome.meta.model_dump()) == outcome.meta


@given(
    payload=st.binary(min_size=1, max_size=64),
    request_id=ids,
    content_type=st.sampled_from(ContentType),
    source=texts.filter(bool),
    params=params,
    deadline=st.none() | aware_datetimes,
    time=st.none() | aware_datetimes,
    capture_time=st.none() | aware_datetimes,
    reply_to=st.none() | topics,
    stream=st.none() | ids,
    seq=st.integers(min_value=0, max_value=2**63 - 1),
    supersede=st.none() | st.booleans(),
    traceparent=st.none() | traceparents,
    timestamp_ms=st.integers(min_value=0, max_value=2**45),
)
def test_encode_then_decode_round_trips(
    payload: bytes,
    request_id: str,
    content_type: ContentType,
    source: str,
    params: dict[str, Any],
    deadline: datetime | None,
    time: datetime | None,
    capture_time: datetime | None,
    reply_to: str | None,
    stream: str | None,
    seq: int,
    supersede: bool | None,
    traceparent: str | None,
    timestamp_ms: int,
) -> None:
    record = encode_request(
        payload,
        request_id=request_id,
        content_type=content_type,
        source=source,
        params=params,
        deadline=deadline,
        time=time,
        capture_time=capture_time,
        reply_to=reply_to,
        stream=stream,
        seq=seq if stream is not None else None,
        supersede=supersede if stream is not None else None,
        traceparent=traceparent,
    )
    request = decode_request(record.headers, record.key, record.value, timestamp_ms)
    assert request.payload is payload
    assert record.key == (stream or request_id).encode()
    assert request.meta == RequestMeta(
        id=request_id,
        source=source,
        content_type=content_type,
        params=params,
        deadline=deadline,
        time=time,
        capture_time=capture_time,
        reply_to=reply_to,
        stream=stream,
        seq=seq if stream is not None else None,
        supersede=supersede if stream is not None else None,
        traceparent=traceparent,
        timestamp_ms=timestamp_ms,
    )


common = {
    "id": ids,
    "model": texts,
    "model_version": texts,
    "timings": st.none() | timings,
    "worker": texts,
    "attempt": st.integers(min_value=1, max_value=100),
}
ok_results = st.builds(Result, status=st.just(Status.ok), outputs=json_values(4), **common)
failed_results = st.builds(
    Result,
    status=st.sampled_from([Status.error, Status.expired, Status.rejected]),
    error=st.builds(ErrorInfo, code=st.sampled_from(ErrorCode) | texts, message=texts),
    **common,
)


@given(result=ok_results | failed_results)
def test_encode_result_then_decode_result_round_trips(result: Result) -> None:
    assert decode_result(encode_result(result)) == result


@given(
    data=st.binary(max_size=200)
    | st.dictionaries(st.sampled_from(list(Result.model_fields)) | texts, json_values(2)).map(
        orjson.dumps
    )
)
def test_any_bytes_decode_as_a_result_or_raise_contract_error(data: bytes) -> None:
    try:
        decode_result(data)
    except ContractError as err:
        error: ContractError | None = err
    else:
        error = None
    if error is not None:
        assert error.code is ErrorCode.decode_failed
        assert str(error).startswith("result")
