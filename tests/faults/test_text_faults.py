"""Fault scenarios for a text model (``hf:PATH``): the same table as test_faults.py.

A worker serving the tiny text classifier of ``tests.text_models`` is SIGKILLed
mid-backlog, and another takes over: nothing is lost and no id has two visible
answers, as for the image models (its row joins the fault table).
"""

from __future__ import annotations

from pathlib import Path

import pytest

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

# A backlog the SIGKILL lands in the middle of (the kill comes at 100 answered), every
# length bucket many times over; 3,000 took a minute on two cores and checked no more.
REQUESTS = 1000
BATCH_8 = ("--max-batch-size", "8")
# Texts of several lengths (and so of several length buckets), by a stated rule: the
# n-th request repeats a sentence n % 7 + 1 times.
SENTENCE = "the argument parser reads the command line"


def _texts(count: int) -> list[bytes]:
    return [" ".join([SENTENCE] * (n % 7 + 1)).encode() for n in range(count)]


@pytest.mark.timeout(300)
async def test_a_text_worker_sigkilled_mid_backlog_loses_nothing(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    text_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    spec = f"hf:{text_models['text-classification']}"
    scenario = Scenario(
        "text worker SIGKILL mid-backlog, restart",
        setup=steps(
            payload_backlog(_texts(REQUESTS), ContentType.TEXT),
            start(*BATCH_8, model=spec),
            answered(100),
        ),
        fault=steps(kill(0), mid_stream),
        recovery=start(*BATCH_8, model=spec),
    )
    config = WorkerConfig(model_name, kafka_bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    with Fleet(config, tmp_path) as fleet:
        scene = Scene(scenario, model_name, kafka_bootstrap, redis_url, fleet, [], None)
        counted = await play(scene)
    assert counted.answered == REQUESTS
