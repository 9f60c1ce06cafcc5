"""Property tests: any bytes at all only ever raise ContractError, and encode/decode round-trip."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
from hypothesis import event, given
from hypothesis import strategies as st

from schemas import (
    ContentType,
    ContractError,
    ErrorCode,
    ErrorInfo,
    Header,
    Limits,
    Request,
    RequestMeta,
    Result,
    Status,
    Timings,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    is_valid_request_id,
)

ids = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8"), max_size=40)
topics = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(
    lambda name: name not in (".", "..")
)
traceparents = st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", fullmatch=True).filter(
    lambda value: "-" + "0" * 32 + "-" not in value and "-" + "0" * 16 + "-" not in value
)
offsets = st.integers(min_value=-23 * 3600, max_value=23 * 3600).map(
    lambda seconds: timezone(timedelta(seconds=seconds))
)
aware_datetimes = st.datetimes(
    min_value=datetime(1000, 1, 2), max_value=datetime(9999, 12, 30), timezones=offsets
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)


def json_values(depth: int) -> st.SearchStrategy[Any]:
    if depth == 0:
        return scalars
    inner = json_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3)


# The top-level object is depth 1, so values may nest 7 more within the default of 8.
params = st.dictionaries(texts, json_values(7), max_size=4)

# Header values that get past the first checks, so the random part reaches deep code.
interesting = st.sampled_from(
    [
        b"1.0",
        b"conveyor.request.v1",
        b"image/png",
        b"image/png; charset=utf-8",
        b"req-1",
        b"2025-01-31T12:00:00Z",
        b"9999-12-31T23:59:59-23:59",
        b"{}",
        b'{"a":[[[[[[[[[]]]]]]]]]}',
        b"18446744073709551616",
        b"true",
        b"false",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"\xff",
        b"",
    ]
)
header_names = st.sampled_from([h.value for h in Header]) | texts
header_values = st.none() | interesting | st.binary(max_size=80)
VALID = [
    ("ce_specversion", b"1.0"),
    ("ce_id", b"req-1"),
    ("ce_type", b"conveyor.request.v1"),
    ("ce_source", b"s"),
    ("content-type", b"image/png"),
]


@st.composite
def record_headers(draw: st.DrawFn) -> list[tuple[str, bytes | None]]:
    """Either headers from nothing, or valid headers with some dropped, changed or added."""
    extra = draw(st.lists(st.tuples(header_names, header_values), max_size=12))
    if draw(st.booleans()):
        return extra
    kept = [header for header in VALID if draw(st.integers(0, 5))]
    return draw(st.permutations(kept + extra))


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


finite = st.floats(allow_nan=False, allow_infinity=False)
timings = st.builds(
    Timings,
    produced_ms=st.integers(min_value=0, max_value=2**53),
    received_ms=finite,
    batch_start_ms=st.none() | finite,
    finished_ms=finite,
    queue_ms=finite,
    inference_ms=finite,
    batch_size=st.integers(min_value=0, max_value=4096),
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
