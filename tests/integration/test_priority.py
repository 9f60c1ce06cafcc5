"""Priority lanes against the real broker: high-lane latency under a saturating low-lane backlog.

One worker serves a slow model (every batch takes at least 40 ms) from two lanes,
``high:8`` and the plain request topic. High-lane requests are sent one at a time,
first to the idle worker, then while a backlog of low-lane requests keeps it busy.
The bound: a high-lane request waits for at most the batch on the model and the one
queued behind it (``workers.lanes``), so its p99 latency stays within 3 times an
idle worker's; and the low lane keeps being served meanwhile.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from demo.models.digits import build_digits_model, heldout_digits
from schemas import ContentType, OutgoingRecord, encode_request, topics_for
from tests.integration.harness import (
    WorkerProcess,
    count_results,
    create_model_topics,
    produce,
    until,
    wait_for_results,
)

FAULTY = "tests.faults.faulty:FaultyDigits"
SLOW_MS = 40
PROBES = 30  # high-lane requests per phase
P99_FACTOR = 3.0


@pytest.fixture(scope="module")
def digit_png() -> bytes:
    build_digits_model()
    return heldout_digits()[0][0]


@pytest.fixture
def worker(
    kafka_bootstrap: str, redis_url: str, model_name: str, tmp_path: Path
) -> Iterator[WorkerProcess]:
    process = WorkerProcess(
        model_name,
        kafka_bootstrap,
        redis_url,
        tmp_path / "worker.log",
        ("--lanes", "high:8", "--max-batch-size", "8"),
        FAULTY,
        {"CONVEYOR_TEST_SLOW_MS": str(SLOW_MS)},
    )
    yield process
    process.stop()


def request(png: bytes, request_id: str) -> OutgoingRecord:
    return encode_request(png, request_id=request_id, content_type=ContentType.PNG, source="t")


async def probe(bootstrap: str, redis_url: str, topic: str, png: bytes, prefix: str) -> list[float]:
    """Send PROBES requests one at a time, 100 ms apart; their latencies in seconds, from
    the record timestamp to the result being sent to Redis (both on this host's clock)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    ids = [f"{prefix}-{n}" for n in range(PROBES)]
    try:
        for request_id in ids:
            record = request(png, request_id)
            await producer.send_and_wait(
                topic, record.value, key=record.key, headers=record.headers
            )
            await asyncio.sleep(0.1)  # the probes' pace, not a wait for readiness
    finally:
        await producer.stop()
    results = await wait_for_results(redis_url, ids, 60)
    assert len(results) == PROBES
    latencies = []
    for result in results.values():
        assert result.timings is not None
        assert result.timings.published_ms is not None
        latencies.append((result.timings.published_ms - result.timings.produced_ms) / 1000.0)
    return latencies


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


@pytest.mark.timeout(240)
async def test_high_lane_latency_holds_under_a_low_lane_backlog(
    worker: WorkerProcess,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digit_png: bytes,
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(kafka_admin, model_name, partitions=2)
    await kafka_admin.create_topics([NewTopic(topics.lane("high"), 2, 1)])
    worker.start()
    await until(lambda: "ready: serving" in worker.log(), "the worker is ready", 120, worker.log)
    high = topics.lane("high")
    idle = await probe(kafka_bootstrap, redis_url, high, digit_png, f"{model_name}-idle")

    backlog = [f"{model_name}-low-{n}" for n in range(3000)]
    await produce(kafka_bootstrap, topics.requests, [request(digit_png, i) for i in backlog])
    started = time.monotonic()
    while await count_results(redis_url, backlog) < 100:  # the worker is saturated
        assert time.monotonic() - started < 60, worker.log()[-3000:]
        await asyncio.sleep(0.05)
    low_before = await count_results(redis_url, backlog)
    loaded = await probe(kafka_bootstrap, redis_url, high, digit_png, f"{model_name}-busy")
    low_after = await count_results(redis_url, backlog)

    print(
        f"high lane p99: idle {p99(idle) * 1000:.0f} ms, under a low backlog "
        f"{p99(loaded) * 1000:.0f} ms (median {statistics.median(idle) * 1000:.0f} / "
        f"{statistics.median(loaded) * 1000:.0f} ms); low lane answered {low_after - low_before} "
        f"meanwhile, {len(backlog) - low_after} still waiting"
    )
    assert low_after < len(backlog), "the backlog must outlast the probes"
    assert p99(loaded) <= P99_FACTOR * p99(idle)
    assert low_after - low_before > 100  # the low lane is not starved
