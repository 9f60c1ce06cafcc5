"""The worker process's own set-up around the pipeline (workers/app.py)."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

from workers import app
from workers.app import start_up_objects_frozen, switch_interval
from workers.settings import WorkerSettings
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


def test_the_worker_serves_with_its_switch_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []

    async def preflight(*_: object) -> None:  # the first step that needs Kafka and Redis
        seen.append(sys.getswitchinterval())
        raise ConfigError("stop here")

    monkeypatch.setattr(app, "_preflight", preflight)
    settings = WorkerSettings(
        model="bench.identity:IdentityHandler", switch_interval_ms=0.75, metrics_port=0
    )
    before = sys.getswitchinterval()
    with pytest.raises(ConfigError, match="stop here"):
        asyncio.run(app.run_worker(settings))
    assert seen == [pytest.approx(0.00075)]
    assert sys.getswitchinterval() == before


def test_the_default_switch_interval_is_shorter_than_pythons() -> None:
    assert WorkerSettings(model="bench.identity:IdentityHandler").switch_interval_ms < 5.0
