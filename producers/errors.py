"""Errors the client raises, each saying what went wrong and what to do.

Input the contract refuses (a payload too large, bad params, a bad request
id) raises ``schemas.ContractError`` before anything is sent; everything else
is a ``ClientError``. ``retriable`` tells whether trying again later may help.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

# How many ids a message lists before it says "and N more".
_SHOWN_IDS = 5


class ClientError(Exception):
    """Base class of the client's own errors."""

    retriable: ClassVar[bool] = False


class InvalidInput(ClientError, ValueError):
    """A payload or argument the client cannot send: unreadable file, unknown media type, ..."""


class UnknownModel(ClientError):
    """The model's request topic does not exist, so nothing would ever serve the request."""

    def __init__(self, model: str, topic: str) -> None:
        super().__init__(
            f"topic {topic} does not exist, so no worker serves model {model!r}: "
            f"create it with `conveyor topics create --model {model} --partitions N` "
            "(N >= the most workers you plan to run; --lanes NAME for a priority lane), "
            "then start `conveyor worker`"
        )
        self.model = model
        self.topic = topic


class RecordTooLarge(ClientError):
    """The broker refused a request record as larger than its topic accepts.

    ``limit_bytes`` is the topic's ``max.message.bytes`` when it could be read. Records
    of the same ``submit_many`` call that fit may have been sent.
    """

    def __init__(
        self, topic: str, record_bytes: int, limit_bytes: int | None, needed_bytes: int
    ) -> None:
        accepts = (
            f"accepts at most {limit_bytes} bytes (its max.message.bytes)"
            if limit_bytes is not None
            else "has a lower max.message.bytes (or the broker a lower message.max.bytes)"
        )
        super().__init__(
            f"Kafka refused a record of about {record_bytes} bytes as too large: topic "
            f"{topic} {accepts}. Requests within the payload limit need up to "
            f"{needed_bytes} bytes; raise the topic's limit with `kafka-configs.sh "
            f"--alter --entity-type topics --entity-name {topic} --add-config "
            f"max.message.bytes={needed_bytes}` (`conveyor topics create` sets it on new "
            "topics), or send smaller payloads"
        )
        self.topic = topic
        self.record_bytes = record_bytes
        self.limit_bytes = limit_bytes


class ServiceUnavailable(ClientError):
    """Kafka or Redis could not be reached in time."""

    retriable: ClassVar[bool] = True


class SourceLost(ServiceUnavailable):
    """A live video source dropped and could not be reopened within its reconnection window."""

    def __init__(self, source: str, after_seq: int, reason: str, reconnect_for: float) -> None:
        super().__init__(
            f"live source {source} dropped after frame {after_seq} ({reason}) and could not "
            f"be reopened within {reconnect_for:g} s: check the camera or the stream's server, "
            "or give it longer with --reconnect-for"
        )
        self.source = source
        self.after_seq = after_seq
        self.reason = reason


class ConnectionsBusy(ClientError):
    """Every Redis connection of the client's pool stayed busy while a call waited for one."""

    retriable: ClassVar[bool] = True

    def __init__(self, max_connections: int, waited_s: float | None) -> None:
        super().__init__(
            f"all {max_connections} Redis connections of this client stayed busy for "
            f"{waited_s:g} s: too many calls at once for its pool, or Redis answering slowly. "
            "Raise redis_max_connections (CONVEYOR_REDIS_MAX_CONNECTIONS) or "
            "redis_pool_timeout_s (CONVEYOR_REDIS_POOL_TIMEOUT_S), or make fewer calls at once"
        )
        self.max_connections = max_connections


class ResultTimeout(ClientError, TimeoutError):
    """No result arrived in time. ``request_ids`` are the ones still pending."""

    retriable: ClassVar[bool] = True

    def __init__(self, request_ids: Sequence[str], timeout: float) -> None:
        self.request_ids = tuple(request_ids)
        self.timeout = timeout
        shown = ", ".join(self.request_ids[:_SHOWN_IDS])
        more = len(self.request_ids) - _SHOWN_IDS
        if more > 0:
            shown += f" and {more} more"
        noun = "request" if len(self.request_ids) == 1 else f"{len(self.request_ids)} requests"
        super().__init__(
            f"no result within {timeout:g} s for {noun} {shown}: it may still be queued or "
            "running (is a worker running for its model?), or no request with that id was "
            "sent; `status` tells which where it can. Wait again or read it later by id"
        )
