"""Priority lanes against the real broker: high-lane latency under a saturating low-lane backlog.

One worker serves a slow model (every batch takes at least 40 ms) from two lanes,
``high:8`` and the plain request topic. High-lane requests are sent one at a time,
first to the idle worker, then while a backlog of low-lane requests keeps it busy.
The bound: a high-lane request waits for at most the batch on the model and the one
queued behind it (``workers.batching.lanes``), so its p99 latency stays within 3 times an
idle worker's; and the low lane keeps being served meanwhile.
"""

from __future__ import annotations

import statistics

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    count_results,
    produce,
    produce_at_rate,
    until_answered,
    wait_for_results,
)
from schemas import ContentType, OutgoingRecord, encode_request, topics_for
from tests.faults import faulty

SLOW_MS = 40
PROBES = 30  # high-lane requests per phase
P99_FACTOR = 3.0


def request(png: bytes, request_id: str) -> OutgoingRecord:
    return encode_request(png, request_id=request_id, content_type=ContentType.PNG, source="t")


async def probe(bootstrap: str, redis_url: str, topic: str, png: bytes, prefix: str) -> list[float]:
    """Send PROBES requests one at a time, 100 ms apart; their latencies in seconds, from
    the record timestamp to the result being sent to Redis (both on this host's clock)."""
    ids = [f"{prefix}-{n}" for n in range(PROBES)]
    await produce_at_rate(bootstrap, topic, [request(png, i) for i in ids], rate=10)
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
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    digit_png = digits[0][0]
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2, lanes=["high"])
    worker = workers.start(
        *("--lanes", "high:8", "--max-batch-size", "8"),
        model=faulty.SPEC,
        env={"CONVEYOR_TEST_SLOW_MS": str(SLOW_MS)},
    )
    await worker.until_serving(120)
    high = topics.lane("high")
    idle = await probe(kafka_bootstrap, redis_url, high, digit_png, f"{model_name}-idle")

    backlog = [f"{model_name}-low-{n}" for n in range(3000)]
    await produce(kafka_bootstrap, topics.requests, [request(digit_png, i) for i in backlog])
    await until_answered(redis_url, backlog, 100, timeout_s=60)  # the worker is saturated
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
