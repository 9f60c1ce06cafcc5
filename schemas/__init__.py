"""Conveyor's wire contract, version 1: everything that crosses a process boundary.

Request records (Kafka), result documents (Redis and the reply topic) and
dead-letter headers are defined here and nowhere else. This package does no
I/O and depends on no other part of Conveyor; docs/contract.md describes the
same contract for producers and readers in any language.
"""

from schemas.dataref import DEFAULT_DATA_PREFIX, DataRef, parse_dataref, redis_dataref, s3_dataref
from schemas.dlq import dlq_headers
from schemas.errors import ContractError, ErrorCode
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.naming import (
    DEFAULT_LANE,
    ModelTopics,
    Role,
    cancel_key,
    consumer_group,
    is_valid_request_id,
    is_valid_topic,
    payload_key,
    result_key,
    status_key,
    stream_key,
    topics_for,
)
from schemas.outputs import parse_outputs
from schemas.request import (
    REQUEST_TYPE,
    SPECVERSION,
    ContentType,
    Header,
    OutgoingRecord,
    Request,
    RequestMeta,
    decode_request,
    encode_request,
    new_request_id,
)
from schemas.result import (
    RESULT_TYPE,
    ErrorInfo,
    Result,
    Status,
    Timings,
    decode_result,
    encode_result,
    error_result,
    ok_result,
    result_headers,
    status_for,
)

__all__ = [
    "DEFAULT_DATA_PREFIX",
    "DEFAULT_LANE",
    "DEFAULT_LIMITS",
    "REQUEST_TYPE",
    "RESULT_TYPE",
    "SPECVERSION",
    "ContentType",
    "ContractError",
    "DataRef",
    "ErrorCode",
    "ErrorInfo",
    "Header",
    "Limits",
    "ModelTopics",
    "OutgoingRecord",
    "Request",
    "RequestMeta",
    "Result",
    "Role",
    "Status",
    "Timings",
    "cancel_key",
    "consumer_group",
    "decode_request",
    "decode_result",
    "dlq_headers",
    "encode_request",
    "encode_result",
    "error_result",
    "is_valid_request_id",
    "is_valid_topic",
    "new_request_id",
    "ok_result",
    "parse_dataref",
    "parse_outputs",
    "payload_key",
    "redis_dataref",
    "result_headers",
    "result_key",
    "s3_dataref",
    "status_for",
    "status_key",
    "stream_key",
    "topics_for",
]
