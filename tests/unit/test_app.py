"""The worker process's own set-up around the pipeline (workers/app.py)."""

from __future__ import annotations

import asyncio
import gc
import sys
from typing import Any

import pytest
import redis.asyncio as aioredis

from common.security import ConnectFailed
from schemas import topics_for
from workers import app
from workers.app import start_up_objects_frozen, switch_interval
from workers.config.worker import WorkerSettings
from workers.types import ConfigError


def test_start_up_objects_leave_the_collector_while_serving_and_return_after() -> None:
    made_at_start_up = [object() for _ in range(10)]  # a stand-in for the model
    assert gc.get_freeze_count() == 0
    with start_up_objects_frozen():
        assert gc.get_freeze_count() >= len(made_at_start_up)
        assert gc.collect() >= 0  # collections still run, over what serving makes
    assert gc.get_freeze_count() == 0


def test_an_error_while_serving_still_unfreezes() -> None:
    try:
        with start_up_objects_frozen():
            raise RuntimeError("model crashed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_the_switch_interval_holds_while_serving_and_returns_after() -> None:
    before = sys.getswitchinterval()
    with switch_interval(0.25):
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize(
    ("given", "expected_ms"),
    [({"switch_interval_ms": 0.75}, 0.75), ({"profile": "latency"}, 0.2), ({}, 0.5)],
)
def test_the_worker_serves_with_its_switch_interval(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, Any], expected_ms: float
) -> None:
    """Given, or the profile's once the model is loaded (``tuned``); restored after."""
    seen: list[float] = []

    async def preflight(*_: object) -> None:  # the first step that needs Kafka and Redis
        return None

    class Publisher:  # the first part made after the model, before any request
        def __init__(self, *_: object) -> None:
            seen.append(sys.getswitchinterval())

        async def __aenter__(self) -> None:
            raise ConfigError("stop here")

        async def __aexit__(self, *_: object) -> None:
            return None

    monkeypatch.setattr(app, "_preflight", preflight)
    monkeypatch.setattr(app, "Publisher", Publisher)
    settings = WorkerSettings(model="bench.identity:IdentityHandler", metrics_port=0, **given)
    before = sys.getswitchinterval()
    with pytest.raises(ConfigError, match="stop here"):
        asyncio.run(app.run_worker(settings))
    assert seen == [pytest.approx(expected_ms / 1000.0)]
    assert sys.getswitchinterval() == before


def test_the_default_switch_interval_is_shorter_than_pythons() -> None:
    assert WorkerSettings(model="bench.identity:IdentityHandler").switch_interval_ms < 5.0


CLOSED = "unable to perform operation on <TCPTransport closed=True>; the handler is closed"


@pytest.mark.parametrize(
    ("message", "raised", "match"),
    [
        (CLOSED, ConnectFailed, r"cannot connect to Redis at redis://127\.0\.0\.1:1/0: .*closed"),
        ("a bug, not an outage", RuntimeError, "^a bug, not an outage$"),
    ],
)
def test_a_redis_that_closes_the_first_connection_is_a_connect_failure(
    monkeypatch: pytest.MonkeyPatch, message: str, raised: type[Exception], match: str
) -> None:
    async def ping(_: object) -> bool:
        raise RuntimeError(message)

    monkeypatch.setattr(aioredis.Redis, "ping", ping)
    settings = WorkerSettings(
        model="bench.identity:IdentityHandler", redis_url="redis://127.0.0.1:1/0"
    )
    with pytest.raises(raised, match=match):
        asyncio.run(app._preflight(settings, topics_for("t")))


async def test_a_drain_that_ends_in_time_is_a_clean_stop() -> None:
    stop = asyncio.Event()
    drained = []

    async def run(stop: asyncio.Event) -> None:
        await stop.wait()
        await asyncio.sleep(0.05)  # the drain: records finished, results written
        drained.append(True)

    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await app.serve(run, stop, drain_s=5.0) is True
    assert drained == [True]


async def test_a_drain_stuck_in_retries_is_cut_short_after_its_bound() -> None:
    stop = asyncio.Event()
    cancelled = []

    async def run(stop: asyncio.Event) -> None:
        await stop.wait()
        try:
            await asyncio.Event().wait()  # results that can never be written
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = asyncio.get_running_loop().time()
    assert await app.serve(run, stop, drain_s=0.3) is False
    assert 0.3 <= asyncio.get_running_loop().time() - started < 2
    assert cancelled == [True]


async def test_an_error_that_ends_serving_is_raised() -> None:
    async def run(stop: asyncio.Event) -> None:
        raise ConfigError("Redis refused this worker's writes")

    with pytest.raises(ConfigError, match="refused"):
        await app.serve(run, asyncio.Event(), drain_s=5.0)


async def test_an_error_raised_while_the_drain_is_cut_short_is_raised() -> None:
    stop = asyncio.Event()
    stop.set()

    async def run(stop: asyncio.Event) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise ConfigError("past its grace")

    with pytest.raises(ConfigError, match="past its grace"):
        await app.serve(run, stop, drain_s=0.1)
