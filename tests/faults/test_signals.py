"""A signal always stops a worker, within its drain bound, whatever holds its results up.

A worker's results wait for Redis and Kafka while they are down, retried without end;
its drain after SIGTERM or SIGINT waits for them at most ``--max-drain-ms``, and the
process exits at most ``workers.app.CLOSE_S`` later (docs/operations.md). Here the
worker is stuck retrying while its own Redis, or its own Kafka broker, is stopped: it
must exit with status 0 within that bound, having committed nothing it did not answer,
and a worker started once the service is back answers every request. Both signals reach
one handler (``workers.app``), so each outage is tried with one of them: SIGINT for
Redis, SIGTERM for Kafka. (Refusals rather than outages:
tests/integration/test_redis_acl.py and test_kafka_acl.py.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from producers.testing import Fleet, WorkerProcess, http_get, produce, until, until_answered
from schemas import topics_for
from tests.faults.faulty import SPEC as FAULTY
from tests.harness import NOTES, LocalService, check, setup_model, tally_scenario
from workers.app import CLOSE_S

DRAIN_MS = 2000
BOUND_S = DRAIN_MS / 1000 + CLOSE_S


async def _stalled(worker: WorkerProcess) -> bool:
    """Its /readyz fails on results_durable: results have not become durable for a while."""
    port = worker.metrics_port()
    if port is None:
        return False
    try:
        status, body = await http_get(port, "/readyz")
    except OSError:
        return False
    return status == 503 and json.loads(body)["checks"]["results_durable"] != "ok"


async def _stops_within_its_bound(worker: WorkerProcess, signum: signal.Signals) -> float:
    """Send ``signum``; the worker must exit 0 within ``BOUND_S``. Seconds it took."""
    signalled = time.monotonic()
    worker.signal(signum)
    status = await worker.exited(BOUND_S + 30)
    took = time.monotonic() - signalled
    assert status == 0, worker.log()[-4000:]
    assert took < BOUND_S, worker.log()[-4000:]
    assert "drain cut short" in worker.log(), worker.log()[-4000:]
    return took


@pytest.mark.timeout(240)
async def test_a_worker_stuck_on_a_redis_outage_stops_on_sigint_within_its_bound(
    private_redis: LocalService,
    kafka_bootstrap: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    records, ids = await setup_model(kafka_bootstrap, model_name, digits, 40, partitions=1)
    worker = workers.start("--max-drain-ms", str(DRAIN_MS), redis_url=private_redis.url)
    await worker.until_serving()
    await asyncio.to_thread(private_redis.stop)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    await until(lambda: "redis failed" in worker.log(), "an outage", 60, worker.log, [worker])
    took = await _stops_within_its_bound(worker, signal.SIGINT)

    await asyncio.to_thread(private_redis.start)
    workers.start(redis_url=private_redis.url)
    scenario = "SIGINT while Redis is down"
    counted = await tally_scenario(scenario, kafka_bootstrap, private_redis.url, model_name, ids)
    check(counted, workers.logs())
    NOTES.append(f"{scenario}: exit 0 {took:.1f} s after the signal (--max-drain-ms {DRAIN_MS})")


@pytest.mark.timeout(300)
async def test_a_worker_stuck_on_a_kafka_outage_stops_on_sigterm_within_its_bound(
    private_kafka: LocalService,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    """The broker stops while batches of a slow model are in flight: their results can be
    stored in Redis but not sent to the reply topic."""
    bootstrap = private_kafka.bootstrap
    records, ids = await setup_model(bootstrap, model_name, digits, 400, partitions=1)
    await produce(bootstrap, topics_for(model_name).requests, records)
    worker = workers.start(
        *("--max-drain-ms", str(DRAIN_MS), "--max-batch-size", "8", "--unready-after-s", "1"),
        model=FAULTY,
        kafka_bootstrap=bootstrap,
        env={"CONVEYOR_TEST_SLOW_MS": "200"},
    )
    await until_answered(redis_url, ids, 16, 120)
    await asyncio.to_thread(private_kafka.stop)
    # Its reply records wait in the producer, which retries them until its request
    # time-out (40 s), then the publisher's retries take over: stalled all along, and
    # unready once a write has waited --unready-after-s, long before the time-out.
    stopped = time.monotonic()
    await until(lambda: _stalled(worker), "stalled", 60, worker.log, [worker])
    assert time.monotonic() - stopped < 20, worker.log()[-4000:]
    took = await _stops_within_its_bound(worker, signal.SIGTERM)

    await asyncio.to_thread(private_kafka.start)
    workers.start(kafka_bootstrap=bootstrap)
    scenario = "SIGTERM while Kafka is down"
    counted = await tally_scenario(scenario, bootstrap, redis_url, model_name, ids, 180)
    check(counted, workers.logs())
    NOTES.append(f"{scenario}: exit 0 {took:.1f} s after the signal (--max-drain-ms {DRAIN_MS})")
