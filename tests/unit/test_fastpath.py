"""The hot-path codecs equal the full ones: property tests against decode_request and
the pydantic result path."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from schemas import (
    ContentType,
    ContractError,
    ErrorCode,
    Limits,
    Result,
    Status,
    Timings,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)
from schemas.fastpath import ResultEncoder, parse_request
from tests.strategies import (
    VALID,
    aware_datetimes,
    ids,
    interesting,
    json_values,
    params,
    record_headers,
    texts,
    timings,
    topics,
    traceparents,
)

OPTIONAL = [
    "ce_time",
    "ce_capturetime",
    "ce_deadline",
    "ce_replyto",
    "ce_params",
    "ce_stream",
    "ce_seq",
    "ce_supersede",
    "traceparent",
    "ce_dataref",
    "ce_dataexpires",
]
near_valid = st.builds(
    lambda base, extra, order: order.sample(base + extra, len(base) + len(extra)),
    st.just(VALID),
    st.lists(
        st.tuples(st.sampled_from(OPTIONAL) | texts, interesting | st.binary(max_size=12)),
        max_size=4,
    ),
    st.randoms(use_true_random=False),
)


@settings(max_examples=500)
@given(
    headers=record_headers() | near_valid,
    value=st.none() | st.binary(max_size=40),
    max_payload=st.integers(min_value=1, max_value=50),
)
def test_fast_parse_accepts_nothing_the_decoder_refuses(
    headers: list[tuple[str, bytes | None]], value: bytes | None, max_payload: int
) -> None:
    limits = Limits(max_payload_bytes=max_payload)
    fast = parse_request(headers, value, limits)
    try:
        meta = decode_request(headers, None, value, 0, limits).meta
    except ContractError:
        assert fast is None
        event("refused by both")
        return
    if fast is None:
        event("fast path declined a valid record")
        return
    event("accepted by both")
    assert fast == (
        meta.id,
        meta.content_type,
        meta.params,
        meta.deadline,
        meta.reply_to,
        meta.stream,
        meta.seq,
        meta.traceparent,
        meta.supersede,
        meta.dataref,
    )


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
)
def test_fast_parse_takes_every_record_the_sdk_writes(
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
    fast = parse_request(record.headers, record.value, Limits())
    meta = decode_request(record.headers, record.key, record.value, 0).meta
    assert fast is not None
    assert fast.id == meta.id
    assert fast.params == meta.params
    assert (
        fast.deadline,
        fast.reply_to,
        fast.stream,
        fast.seq,
        fast.traceparent,
        fast.supersede,
    ) == (meta.deadline, meta.reply_to, meta.stream, meta.seq, meta.traceparent, meta.supersede)


@given(
    request_id=ids,
    model=texts,
    version=texts,
    worker=texts,
    outputs=json_values(4),
    timing=st.none() | timings,
    attempt=st.integers(min_value=1, max_value=100),
)
def test_encoded_ok_results_read_back_as_the_pydantic_result(
    request_id: str,
    model: str,
    version: str,
    worker: str,
    outputs: Any,
    timing: Timings | None,
    attempt: int,
) -> None:
    encoder = ResultEncoder(model, version, worker)
    timings_doc = None if timing is None else timing.model_dump()
    data = encoder.encode(request_id, Status.ok, outputs, None, timings_doc, attempt)
    expected = Result(
        id=request_id,
        status=Status.ok,
        model=model,
        model_version=version,
        outputs=outputs,
        timings=timing,
        worker=worker,
        attempt=attempt,
    )
    assert decode_result(data) == decode_result(encode_result(expected)) == expected


@given(
    request_id=ids,
    status=st.sampled_from([Status.error, Status.expired, Status.rejected]),
    code=st.sampled_from(ErrorCode) | texts,
    message=texts,
    timing=st.none() | timings,
)
def test_encoded_error_results_read_back_as_the_pydantic_result(
    request_id: str, status: Status, code: str, message: str, timing: Timings | None
) -> None:
    encoder = ResultEncoder("m", "v", "w")
    timings_doc = None if timing is None else timing.model_dump()
    data = encoder.encode(request_id, status, None, (str(code), message), timings_doc)
    expected = Result.model_validate(
        {
            "id": request_id,
            "status": status,
            "model": "m",
            "model_version": "v",
            "error": {"code": code, "message": message},
            "timings": timing,
            "worker": "w",
        }
    )
    assert decode_result(data) == expected


def test_outputs_json_cannot_carry_become_an_internal_error() -> None:
    encoder = ResultEncoder("m", "v", "w")
    with pytest.raises(ContractError) as caught:
        encoder.encode("r1", Status.ok, {"x": object()}, None, None)
    assert caught.value.code is ErrorCode.internal
    assert caught.value.request_id == "r1"


def test_result_event_ids_are_distinct_and_headers_name_the_request() -> None:
    encoder = ResultEncoder("digits", "v1", "host-1")
    first = dict(encoder.headers("r1", None))
    second = dict(encoder.headers("r2", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"))
    assert first["ce_id"] != second["ce_id"]
    assert ResultEncoder("digits", "v1", "host-1").headers("r1", None)[4] != (
        "ce_id",
        first["ce_id"],
    )
    assert first["ce_subject"] == b"r1"
    assert first["ce_type"] == b"conveyor.result.v1"
    assert first["ce_source"] == b"/conveyor/digits/host-1"
    assert "traceparent" not in first
    assert second["traceparent"].startswith(b"00-")
