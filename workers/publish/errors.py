"""What a failed write of results means, and how long to keep trying it.

Errors are sorted by what retrying can do (``Failures``):

- outages (connection refused or reset, time-outs, leader elections, Redis
  loading, read-only during a failover, busy with another script, out of memory
  or unable to persist until keys expire or a disk is freed, a Redis Cluster
  moving slots; ``is_outage`` and not ``config_problem``) are retried with capped
  backoff and never skipped, while the worker's backpressure pauses consumption;
- configuration errors make the worker unready at once and, if they persist for
  ``permanent_error_grace_s``, end it with ``PublishConfigError``, never a
  silent stall. They are authorization refused by Kafka (naming the topic and
  the ACL) or by Redis (naming the grant, ``redis_grant``), a topic that went
  missing, and any other answer of Redis to the result script (an unknown
  command, a key of another type): Redis understood the write and refused it, so
  the same write cannot succeed later.

Redis refuses a command in three ways, all of them configuration errors:
``NOPERM`` before a command runs (``EVALSHA``, ``SCRIPT LOAD``, ``PING``, a key
outside the user's patterns); ``NOPERM`` from the result script's own check of
its grants (``workers.publish.result_store``); and, for a command a Lua script
runs, a plain ``ERR`` (``scriptVerifyACL`` in Redis' script.c): "The user
executing the script can't run this command or subcommand", "... can't access at
least one of the keys ...", "... can't publish to the channel ..." or "... is
lacking the permissions for the command" up to Redis 7.0 (inside "Error running
script" in 6.2), and "ACL failure in script: User <name> has no permissions to
run the '<command>' command", "... No permissions to access a key" or "... No
permissions to access a channel" from Redis 7.2 and in Valkey 7.2 and 8.

Records the broker refuses as too large are the publisher's to handle
(``workers.publish.publisher``): retrying them as they are cannot help.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaError,
    KafkaTimeoutError,
    ProducerClosed,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas.naming import DEFAULT_RESULT_PREFIX
from workers.types import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0
_KAFKA_CONFIG = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError)
_CLOSED_TRANSPORT = "the handler is closed"  # uvloop: "unable to perform operation on <...>; ..."

RESULT_KEYS = f"~{DEFAULT_RESULT_PREFIX}*"
RESULT_CHANNELS = f"&{DEFAULT_RESULT_PREFIX}*"
# Answers Redis gets past on its own: MOVED and ASK (slots moving), TRYAGAIN and
# CLUSTERDOWN (a failover), READONLY, OOM (keys expire), a script restored after SCRIPT
# FLUSH; and, with no class of their own in redis-py, these codes.
_REDIS_TRANSIENT = (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    TryAgainError,
)
_TRANSIENT_CODES = ("BUSY ", "NOREPLICAS ", "MISCONF ")
# A command a Lua script ran, refused by ACL (see the module's docstring).
_SCRIPT_REFUSALS = ("The user executing the script ", "ACL failure in script: ")
_SCRIPT_CHECK = re.compile(r"this user may not (SET|GET|S?PUBLISH) (\S+?)(?:: (.*))?$", re.S)
_COMMAND_NAMED = re.compile(r"'([^' ]+)' command")


class PublishConfigError(ConfigError):
    """Results cannot become durable until an operator changes the configuration."""


class RedisRefused(ConfigError):
    """Redis answered, but refused this worker's user a command it needs (exit status 3)."""


class WriteRefused(Exception):
    """The broker refused this worker's records for ``topic`` (``TopicAuthorizationFailed``,
    which names no topic): no WRITE ACL there."""

    def __init__(self, topic: str) -> None:
        super().__init__(f"[Error 29] TopicAuthorizationFailedError: {topic}")
        self.topic = topic


class Failures:
    """Retries outages forever, and gives configuration errors a bounded grace."""

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s
        self._failing_since: float | None = None
        self._config_since: float | None = None
        self.config_problem: str | None = None

    def stalled_for(self) -> float:
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    async def retry(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt`` until it succeeds, backing off (capped) between failures.

        An outage is logged at each attempt; a configuration error once, when it starts
        (``failed``), with what to grant or fix."""
        delay = _BACKOFF_START_S
        while True:
            try:
                result = await attempt()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                if self.failed(what, exc) is None:
                    log.warning("%s failed (%s); retrying in %.1f s", what, describe(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            self.succeeded()
            return result

    def succeeded(self) -> None:
        self._failing_since = self._config_since = self.config_problem = None

    def failed(self, what: str, exc: BaseException) -> str | None:
        """Note a failure: its configuration problem, or None for an outage. Raises
        ``PublishConfigError`` for a configuration error past its grace."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        problem = config_problem(what, exc)
        if problem is None:
            return None
        if self._config_since is None:
            self._config_since = now
            log.error("%s; the worker is unready until it is fixed", problem)
        self.config_problem = problem
        if now - self._config_since >= self._grace_s:
            raise PublishConfigError(
                f"{problem} (still failing after {self._grace_s:.0f} s)"
            ) from exc
        return problem


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of Redis, Kafka or the network, which trying again may
    get past: the ones ``config_problem`` names as well, which end only after their grace.

    Among them uvloop's ``RuntimeError`` for a write to a connection its peer already
    closed: redis-py lets it through when Redis goes away between a reconnection and
    its first command (a Redis stopped mid-run, ``tests/faults``)."""
    if isinstance(exc, RedisError | KafkaError | OSError | WriteRefused):
        return True
    return isinstance(exc, RuntimeError) and str(exc).endswith(_CLOSED_TRANSPORT)


def config_problem(what: str, exc: BaseException) -> str | None:
    """A sentence for an error only an operator can fix, else None (an outage)."""
    if isinstance(exc, RedisError):
        return _redis_problem(exc)
    if isinstance(exc, WriteRefused):
        return (
            f"Kafka refused this worker's writes to topic {exc.topic} (not authorized): "
            f"grant its principal WRITE on topic {exc.topic}"
        )
    if not isinstance(exc, KafkaError):
        return None  # OSError: the network
    if isinstance(exc, _KAFKA_CONFIG):
        return f"Kafka refused this worker's writes ({describe(exc)}): grant its ACLs"
    if isinstance(exc, UnknownTopicOrPartitionError):
        return f"a topic results go to does not exist ({describe(exc)}): create it again"
    if exc.retriable or isinstance(exc, KafkaTimeoutError | ProducerClosed):
        return None
    return f"Kafka refused results ({describe(exc)})"


def _redis_problem(exc: RedisError) -> str | None:
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return f"Redis refused this worker's credentials ({describe(exc)}): check its user"
    if not isinstance(exc, ResponseError) or redis_transient(exc):
        return None  # the connection, a time-out, or a state Redis gets past
    grant = redis_grant(exc)
    if grant is not None:
        return f"Redis refused this worker's writes ({describe(exc)}): grant its user {grant}"
    return f"Redis refused the result script ({describe(exc)}); retrying cannot help"


def redis_transient(exc: RedisError) -> bool:
    """Whether Redis refused ``exc``'s command for now only (see ``_REDIS_TRANSIENT``)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, *_REDIS_TRANSIENT)):
        return True
    return str(exc).startswith(_TRANSIENT_CODES)


def redis_grant(exc: BaseException) -> str | None:
    """The ACL grant whose lack ``exc`` reports, as an ``ACL SETUSER`` rule of the
    result store's (``+set on ~conveyor:result:*``, ``+ping``), or None when ``exc`` is
    no refusal of a permission."""
    text = str(exc)
    checked = _SCRIPT_CHECK.search(text) if isinstance(exc, NoPermissionError) else None
    if checked is not None:  # the result script's own check, before it wrote anything
        command, why = checked.group(1).lower(), checked.group(3) or ""
        if command.endswith("publish"):
            if "channel" in why:
                return RESULT_CHANNELS
            if "command" in why:
                return f"+{command}"
            return f"+{command} on {RESULT_CHANNELS}"
        return f"+{command} on {RESULT_KEYS}"
    if not isinstance(exc, NoPermissionError) and not any(r in text for r in _SCRIPT_REFUSALS):
        return None
    named = _COMMAND_NAMED.search(text)
    if named is not None:
        return f"+{named.group(1).lower()}"
    if "channel" in text:
        return RESULT_CHANNELS
    if "key" in text:
        return RESULT_KEYS
    # Redis 7.0 names no command refused inside a script.
    return f"the result script's commands (+set +get +publish on {RESULT_KEYS})"


def refused_at_start(location: str, exc: BaseException) -> RedisRefused | None:
    """``RedisRefused`` naming the grant when ``exc`` (of a first command, e.g. ``PING``)
    is a permission refusal, else None."""
    grant = redis_grant(exc)
    if grant is None:
        return None
    return RedisRefused(
        f"Redis at {location} refused this worker's user ({describe(exc)}): "
        f"grant it {grant} (docs/security.md)"
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
