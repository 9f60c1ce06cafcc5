"""Fault scenarios for a tabular model (``tabular:PATH``): the same table as test_faults.py.

A worker scoring the fraud demo's MLP (``demo.models.fraud``, TorchScript) is SIGKILLed
mid-stream, and another takes over: nothing is lost and no id has two visible answers,
as for the image and text models (its row joins the fault table).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from demo.models.fraud import build, record, transactions
from producers.testing import Fleet, WorkerConfig
from schemas import ContentType
from tests.faults.scenes import (
    Scenario,
    Scene,
    answered,
    kill,
    mid_stream,
    payload_backlog,
    play,
    start,
    steps,
)
from tests.harness import TEST_WORKER_OPTIONS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 3000
BATCH_8 = ("--max-batch-size", "8")


def _records(count: int) -> list[bytes]:
    data = transactions(count, seed=11)
    return [orjson.dumps({"features": record(data, n)}) for n in range(count)]


@pytest.mark.timeout(300)
async def test_a_tabular_worker_sigkilled_mid_stream_loses_nothing(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    tmp_path: Path,
) -> None:
    _, mlp = build(tmp_path / "fraud", train_rows=2000)
    spec = f"tabular:{mlp}"
    scenario = Scenario(
        "tabular worker SIGKILL mid-stream, restart",
        setup=steps(
            payload_backlog(_records(REQUESTS), ContentType.JSON),
            start(*BATCH_8, model=spec),
            answered(100),
        ),
        fault=steps(kill(0), mid_stream),
        recovery=start(*BATCH_8, model=spec),
    )
    config = WorkerConfig(model_name, kafka_bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    with Fleet(config, tmp_path / "workers") as fleet:
        scene = Scene(scenario, model_name, kafka_bootstrap, redis_url, fleet, [], None)
        counted = await play(scene)
    assert counted.answered == REQUESTS
