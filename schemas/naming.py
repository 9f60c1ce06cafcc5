"""Names shared by producers and workers: topics, consumer groups, Redis keys."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from schemas.errors import ContractError, ErrorCode

# Kafka's own rule for topic names (kafka.common.internals.Topic).
MAX_TOPIC_LENGTH = 249
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# The contract's rule for request ids; the same characters are legal in Redis
# keys, Kafka keys and topic-like names without escaping.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
DEFAULT_RESULT_PREFIX = "conveyor:result:"
CANCEL_PREFIX = "conveyor:cancel:"
STATUS_PREFIX = "conveyor:status:"
STREAM_PREFIX = "conveyor:stream:"
_LONGEST_SUFFIX = len(".shadow-results")
DEFAULT_LANE = "default"
"""The lane name of a model's plain request topic, ``<prefix>.<model>.requests``."""
_LANE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
Role = Literal["primary", "canary", "shadow"]
"""What a model's workers are to its callers: the primary group answers them, a canary
answers a share of them (``schemas.canary``), a shadow answers none (its results go to
the shadow results topic only, for ``conveyor compare``)."""


@dataclass(frozen=True)
class ModelTopics:
    """The topics of one model."""

    requests: str  # where producers send requests
    results: str  # where workers publish results (unless a request names ce_replyto)
    dlq: str  # where records that cannot get a result go, with the reason in headers
    shadow_results: str  # where shadow workers publish theirs (never read by callers)

    def lane(self, name: str) -> str:
        """The request topic of priority lane ``name``: ``<requests>.<name>``, and the
        plain request topic for ``default``.

        Raises ``ValueError`` for a name that is not 1–32 characters of
        ``[a-z0-9_-]`` starting with a letter or digit, or a topic name too long.
        """
        if name == DEFAULT_LANE:
            return self.requests
        if _LANE.fullmatch(name) is None:
            raise ValueError(
                f"lane name {name!r} must be 1–32 characters of [a-z0-9_-], "
                "starting with a letter or digit"
            )
        topic = f"{self.requests}.{name}"
        if len(topic) > MAX_TOPIC_LENGTH:
            raise ValueError(
                f"lane topic {topic} would have {len(topic)} characters, "
                f"Kafka allows {MAX_TOPIC_LENGTH}"
            )
        return topic


def is_valid_topic(name: str) -> bool:
    """Whether Kafka accepts ``name`` as a topic name."""
    return (
        0 < len(name) <= MAX_TOPIC_LENGTH
        and name not in (".", "..")
        and _TOPIC_CHARS.fullmatch(name) is not None
    )


def is_valid_request_id(request_id: str) -> bool:
    """Whether ``request_id`` is 1–128 characters of ``[A-Za-z0-9._:-]``."""
    return _REQUEST_ID.fullmatch(request_id) is not None


def _check_fragment(what: str, value: str) -> None:
    if not value or _TOPIC_CHARS.fullmatch(value) is None:
        raise ValueError(
            f"{what} {value!r} cannot be part of a Kafka topic name: "
            "use letters, digits, '.', '_' and '-' only"
        )


def topics_for(model: str, prefix: str = "conveyor") -> ModelTopics:
    """Topics ``<prefix>.<model>.requests``, ``.results``, ``.dlq`` and ``.shadow-results``.

    Raises ``ValueError`` when ``model`` or ``prefix`` has characters Kafka
    refuses in topic names, or when the names would be too long.
    """
    _check_fragment("model name", model)
    _check_fragment("topic prefix", prefix)
    base = f"{prefix}.{model}"
    if len(base) + _LONGEST_SUFFIX > MAX_TOPIC_LENGTH:
        raise ValueError(
            f"model name {model!r} is too long: topic {base}.shadow-results would have "
            f"{len(base) + _LONGEST_SUFFIX} characters, Kafka allows {MAX_TOPIC_LENGTH}"
        )
    return ModelTopics(
        requests=f"{base}.requests",
        results=f"{base}.results",
        dlq=f"{base}.dlq",
        shadow_results=f"{base}.shadow-results",
    )


def consumer_group(model: str, prefix: str = "conveyor", role: Role = "primary") -> str:
    """The consumer group of a model's workers: ``<prefix>.<model>``; a canary's and a
    shadow's are ``<prefix>.<model>.canary`` and ``<prefix>.<model>.shadow``."""
    _check_fragment("model name", model)
    _check_fragment("group prefix", prefix)
    base = f"{prefix}.{model}"
    return base if role == "primary" else f"{base}.{role}"


def result_key(request_id: str, prefix: str = DEFAULT_RESULT_PREFIX) -> str:
    """The Redis key of a request's result: ``conveyor:result:<request id>``.

    Raises ``ContractError`` when ``request_id`` is not a valid request id, so a
    key can never be built from untrusted text.
    """
    return prefix + _checked(request_id)


def cancel_key(request_id: str) -> str:
    """The Redis key that cancels a request: ``conveyor:cancel:{<request id>}``.

    The braces are a Redis Cluster hash tag: a request's cancel and status keys
    live in one slot, so a worker checks and marks a batch with one script per slot.
    """
    return CANCEL_PREFIX + "{" + _checked(request_id) + "}"


def status_key(request_id: str) -> str:
    """The Redis hash that says a request is running: ``conveyor:status:{<request id>}``
    with fields ``attempt``, ``worker`` and ``started_ms``."""
    return STATUS_PREFIX + "{" + _checked(request_id) + "}"


def stream_key(request_id: str) -> str:
    """The Redis Stream of a generation's chunks: ``conveyor:stream:{<request id>}``
    (docs/contract.md, Streams: its events and how to read them)."""
    return STREAM_PREFIX + "{" + _checked(request_id) + "}"


def payload_key(request_id: str, prefix: str) -> str:
    """The Redis key the SDK stores a request's payload under: ``<prefix><request id>``."""
    return prefix + _checked(request_id)


def _checked(request_id: str) -> str:
    if _REQUEST_ID.fullmatch(request_id) is None:
        raise ContractError(
            ErrorCode.bad_request,
            "request_id",
            "a request id is 1–128 characters of [A-Za-z0-9._:-]",
            seen=request_id,
        )
    return request_id
