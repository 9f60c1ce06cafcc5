"""How the publisher sorts errors: outages are retried forever, configuration errors
make the worker unready and end it after their grace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NotLeaderForPartitionError,
    PolicyViolationError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)
from redis._parsers.base import BaseParser
from redis.exceptions import BusyLoadingError, NoPermissionError, ReadOnlyError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas import topics_for
from schemas.fastpath import ResultEncoder
from workers.config.worker import WorkerSettings
from workers.kafka.topics import TopicFacts
from workers.publish.errors import (
    Failures,
    PublishConfigError,
    WriteRefused,
    config_problem,
    is_outage,
    redis_grant,
)
from workers.publish.publisher import Publisher
from workers.types import ConfigError


def _from_redis(reply: str) -> RedisError:
    """The exception redis-py raises for the error ``reply`` (as Redis sends it, without
    its leading ``-``)."""
    parse = cast(Callable[[str], RedisError], BaseParser.parse_error)  # untyped in redis-py
    return parse(reply)


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
        (WriteRefused("conveyor.m.dlq"), "grant its principal WRITE on topic conveyor.m.dlq"),
        (UnknownTopicOrPartitionError(), "does not exist"),
        (PolicyViolationError(), "Kafka refused results"),
        (_from_redis("WRONGPASS invalid username-password pair"), "refused this worker's cred"),
    ],
)
def test_configuration_problems_say_what_to_fix(exc: Exception, says: str) -> None:
    problem = config_problem("x", exc)
    assert problem is not None
    assert says in problem


KEYS, CHANNELS = "~conveyor:result:*", "&conveyor:result:*"
SCRIPT_AT = "script: 4f7c9e1b0a2d3c5e6f708192a3b4c5d6e7f80912, on @user_script:5."


@pytest.mark.parametrize(
    ("reply", "grant"),
    [
        # Refused before anything runs: the command or its keys (Redis 7.0, then 7.2+).
        ("NOPERM this user has no permissions to run the 'evalsha' command", "+evalsha"),
        ("NOPERM User w has no permissions to run the 'script|load' command", "+script|load"),
        ("NOPERM this user has no permissions to run the 'ping' command", "+ping"),
        ("NOPERM this user has no permissions to access one of the keys used as arguments", KEYS),
        ("NOPERM No permissions to access a key", KEYS),
        # The result script's own check of its grants (workers.publish.result_store).
        ("NOPERM this user may not SET conveyor:result:a-1", f"+set on {KEYS}"),
        ("NOPERM this user may not GET conveyor:result:a-1", f"+get on {KEYS}"),
        (
            "NOPERM this user may not PUBLISH conveyor:result:a-1: ERR The user executing the "
            "script can't run this command or subcommand",
            "+publish",
        ),
        (
            "NOPERM this user may not PUBLISH conveyor:result:a-1: ERR The user executing the "
            "script can't publish to the channel mentioned in the command",
            CHANNELS,
        ),
        (
            "NOPERM this user may not PUBLISH conveyor:result:a-1: ERR ACL failure in script: "
            "User w has no permissions to run the 'publish' command",
            "+publish",
        ),
        (
            "NOPERM this user may not SPUBLISH conveyor:result:a-1: ERR ACL failure in script: "
            "No permissions to access a channel",
            CHANNELS,
        ),
        (
            "NOPERM this user may not PUBLISH conveyor:result:a-1: refused",
            f"+publish on {CHANNELS}",
        ),
        # A command a script runs, refused by Redis itself: plain ERR replies.
        (
            "ERR Error running script (call to f_4f7c9e1b): @user_script:5: @user_script: 5: "
            "The user executing the script can't publish to the channel mentioned in the command",
            CHANNELS,
        ),  # Redis 6.2
        (
            f"ERR The user executing the script can't run this command or subcommand {SCRIPT_AT}",
            "the result script's commands",
        ),  # Redis 7.0 names no command
        (
            "ERR The user executing the script can't access at least one of the keys mentioned "
            f"in the command arguments {SCRIPT_AT}",
            KEYS,
        ),
        (
            "ERR The user executing the script can't publish to the channel mentioned in the "
            f"command {SCRIPT_AT}",
            CHANNELS,
        ),
        (
            "ERR ACL failure in script: User w has no permissions to run the 'set' command "
            f"{SCRIPT_AT}",
            "+set",
        ),  # Redis 7.2+, Valkey 7.2 and 8
        (f"ERR ACL failure in script: No permissions to access a key {SCRIPT_AT}", KEYS),
        (f"ERR ACL failure in script: No permissions to access a channel {SCRIPT_AT}", CHANNELS),
    ],
)
def test_every_permission_refusal_is_a_configuration_error_naming_its_grant(
    reply: str, grant: str
) -> None:
    exc = _from_redis(reply)
    named = redis_grant(exc)
    assert named is not None
    assert named.startswith(grant)
    assert is_outage(exc)  # retried through the grace, in case it is granted meanwhile
    problem = config_problem("redis", exc)
    assert problem is not None
    assert f"grant its user {grant}" in problem


@pytest.mark.parametrize(
    "reply",
    [
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "NOREPLICAS Not enough good replicas to write.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "READONLY You can't write against a read only replica.",
        "LOADING Redis is loading the dataset in memory",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "CLUSTERDOWN The cluster is down",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "MOVED 3999 127.0.0.1:6381",
        "NOSCRIPT No matching script. Please use EVAL.",
    ],
)
def test_answers_redis_gets_past_on_its_own_are_outages(reply: str) -> None:
    exc = _from_redis(reply)
    assert is_outage(exc)
    assert config_problem("redis", exc) is None


@pytest.mark.parametrize(
    "reply",
    [
        "ERR unknown command 'evalsha', with args beginning with: ",
        f"WRONGTYPE Operation against a key holding the wrong kind of value {SCRIPT_AT}",
        "CROSSSLOT Keys in request don't hash to the same slot",
        "ERR Error running script (call to f_4f7c): @user_script:3: attempt to call a nil value",
    ],
)
def test_any_other_refusal_of_the_script_cannot_pass_by_retrying(reply: str) -> None:
    exc = _from_redis(reply)
    assert redis_grant(exc) is None
    problem = config_problem("redis", exc)
    assert problem is not None
    assert "retrying cannot help" in problem


async def test_a_configuration_error_is_logged_once_not_at_each_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = Failures(grace_s=0.5)

    async def refused() -> None:
        raise _from_redis("NOPERM this user may not SET conveyor:result:a-1")

    with pytest.raises(PublishConfigError, match=r"grant its user \+set on ~conveyor:result:\*"):
        await failures.retry("redis", refused)
    lines = [r for r in caplog.records if r.name == "workers.publish.errors"]
    assert [r.levelname for r in lines] == ["ERROR"]
    assert "+set on ~conveyor:result:*" in lines[0].getMessage()


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


async def test_writes_waiting_on_kafka_count_as_stalled_from_when_they_began() -> None:
    """A broker that went away fails a write only after the producer's request time-out
    (40 s); until then its acknowledgements just stop coming. The oldest write still
    waiting makes results not durable for as long as it waited, so /readyz fails after
    ``unready_after_s`` instead of 40 s."""
    settings = WorkerSettings(
        model="tests:Echo", kafka_bootstrap="127.0.0.1:9", redis_url="redis://127.0.0.1:9"
    )
    topics = topics_for("m")
    facts = TopicFacts({topics.results: 1, topics.dlq: 1}, {})
    publisher = Publisher(settings, topics, facts, ResultEncoder("m", "v1", "w1"))
    try:
        assert publisher.stalled_for() == 0.0
        with publisher.awaiting_kafka():
            await asyncio.sleep(0.2)
            with publisher.awaiting_kafka():  # a later write: the oldest one counts
                await asyncio.sleep(0.1)
                assert publisher.stalled_for() >= 0.3
            assert publisher.stalled_for() >= 0.3
        assert publisher.stalled_for() == 0.0
    finally:
        await publisher.stop()  # never started: nothing to send
