"""How the publisher sorts errors: outages are retried forever, configuration errors
make the worker unready and end it after their grace."""

from __future__ import annotations

import time

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NotLeaderForPartitionError,
    PolicyViolationError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)
from redis.exceptions import BusyLoadingError, NoPermissionError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError

from workers.publish.errors import Failures, PublishConfigError, config_problem, is_outage
from workers.types import ConfigError

# uvloop's error when redis-py reconnects as Redis goes away (the fault suite's
# "Redis stopped 10 s mid-run" saw it end a worker once): an outage.
CLOSED = RuntimeError(
    "unable to perform operation on <TCPTransport closed=True reading=False 0x55f3>; "
    "the handler is closed"
)


@pytest.mark.parametrize(
    "exc",
    [
        KafkaConnectionError(),
        KafkaTimeoutError(),
        NotLeaderForPartitionError(),
        RedisConnectionError("refused"),
        BusyLoadingError("loading"),
        ReadOnlyError("failover"),
        ConnectionResetError(),
        CLOSED,
    ],
)
def test_outages_are_not_configuration_problems(exc: Exception) -> None:
    assert is_outage(exc)
    assert config_problem("x", exc) is None


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (TopicAuthorizationFailedError(), "grant its ACLs"),
        (UnknownTopicOrPartitionError(), "does not exist"),
        (PolicyViolationError(), "Kafka refused results"),
        (NoPermissionError("NOPERM no permission to run 'evalsha'"), "grant its ACL"),
    ],
)
def test_configuration_problems_say_what_to_fix(exc: Exception, says: str) -> None:
    problem = config_problem("x", exc)
    assert problem is not None
    assert says in problem


@pytest.mark.parametrize("outage", [KafkaConnectionError(), CLOSED])
async def test_an_outage_is_retried_until_it_ends(outage: Exception) -> None:
    failures = Failures(grace_s=0.0)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise outage
        return "done"

    assert await failures.retry("kafka", flaky) == "done"
    assert calls == 3
    assert failures.stalled_for() == 0.0
    assert failures.config_problem is None


async def test_a_configuration_error_ends_after_its_grace() -> None:
    failures = Failures(grace_s=0.3)

    async def refused() -> None:
        raise TopicAuthorizationFailedError()

    started = time.monotonic()
    with pytest.raises(PublishConfigError, match="grant its ACLs") as caught:
        await failures.retry("kafka", refused)
    assert isinstance(caught.value, ConfigError)
    assert 0.3 <= time.monotonic() - started < 5
    assert failures.config_problem is not None
    assert failures.stalled_for() > 0


async def test_a_configuration_error_fixed_in_time_clears() -> None:
    failures = Failures(grace_s=30.0)
    calls = 0

    async def fixed_later() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise NoPermissionError("NOPERM")
        return "ok"

    assert await failures.retry("redis", fixed_later) == "ok"
    assert failures.config_problem is None
    assert failures.stalled_for() == 0.0


async def test_any_other_error_is_not_retried() -> None:
    failures = Failures(grace_s=0.0)
    calls = 0

    async def broken() -> str:
        nonlocal calls
        calls += 1
        raise RuntimeError("a bug in the publisher")

    with pytest.raises(RuntimeError, match="a bug"):
        await failures.retry("redis", broken)
    assert calls == 1
    assert not is_outage(ValueError("bad"))
