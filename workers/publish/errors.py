"""What a failed write of results means, and how long to keep trying it.

Errors are sorted by what retrying can do (``Failures``):

- outages (connection refused or reset, time-outs, leader elections, Redis
  loading or read-only during a failover; ``is_outage``) are retried with capped
  backoff and never skipped, while the worker's backpressure pauses consumption;
- configuration errors (authorization refused by Kafka or Redis, a topic that
  went missing) make the worker unready at once and, if they persist for
  ``permanent_error_grace_s``, end it with ``PublishConfigError``, never a
  silent stall.

Records the broker refuses as too large are the publisher's to handle
(``workers.publish.publisher``): retrying them as they are cannot help.
"""

from __future__ import annotations

import asyncio
import logging
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
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from workers.types import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0
_KAFKA_CONFIG = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError)
_REDIS_CONFIG = (NoPermissionError, AuthenticationError)
_CLOSED_TRANSPORT = "the handler is closed"  # uvloop: "unable to perform operation on <...>; ..."


class PublishConfigError(ConfigError):
    """Results cannot become durable until an operator changes the configuration."""


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
        """Run ``attempt`` until it succeeds, backing off (capped) between failures."""
        delay = _BACKOFF_START_S
        while True:
            try:
                result = await attempt()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.failed(what, exc)
                log.warning("%s failed (%s); retrying in %.1f s", what, describe(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            self.succeeded()
            return result

    def succeeded(self) -> None:
        self._failing_since = self._config_since = self.config_problem = None

    def failed(self, what: str, exc: BaseException) -> None:
        """Note a failure; raises ``PublishConfigError`` for a configuration error past grace."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        problem = config_problem(what, exc)
        if problem is None:
            return
        if self._config_since is None:
            self._config_since = now
            log.error("%s; the worker is unready until it is fixed", problem)
        self.config_problem = problem
        if now - self._config_since >= self._grace_s:
            raise PublishConfigError(
                f"{problem} (still failing after {self._grace_s:.0f} s)"
            ) from exc


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of Redis, Kafka or the network, which trying again may
    get past: the ones ``config_problem`` names as well, which end only after their grace.

    Among them uvloop's ``RuntimeError`` for a write to a connection its peer already
    closed: redis-py lets it through when Redis goes away between a reconnection and
    its first command (a Redis stopped mid-run, ``tests/faults``)."""
    if isinstance(exc, RedisError | KafkaError | OSError):
        return True
    return isinstance(exc, RuntimeError) and str(exc).endswith(_CLOSED_TRANSPORT)


def config_problem(what: str, exc: BaseException) -> str | None:
    """A sentence for an error only an operator can fix, else None (an outage)."""
    if isinstance(exc, RedisError):
        refused = isinstance(exc, _REDIS_CONFIG) or (
            isinstance(exc, ResponseError) and str(exc).startswith(("NOPERM", "WRONGPASS"))
        )
        return (
            f"Redis refused this worker's writes ({describe(exc)}): grant its ACL"
            if (refused)
            else None
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


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
