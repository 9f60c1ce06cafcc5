"""Freshest-frame mode against the real broker: four live streams at twice a worker's capacity.

The worker serves a slow model (every batch of at most 4 frames takes at least 50 ms:
at most 80 frames/s) while four streams send 40 frames/s each, 160 frames/s in all,
for 6 s. With ``ce_supersede: true`` a frame still waiting when a newer frame of its
stream arrives is answered ``superseded``, so the frames that do run are recent: their
age (record timestamp to result) stays below ``MAX_AGE_S`` however long the load
lasts, while without the mode the backlog, and so the age, grows by half a second per
second. Either way every frame gets exactly one result, and a stream's ``ok`` results
come in frame order on the reply topic.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from demo.models.digits import build_digits_model, heldout_digits
from schemas import (
    ContentType,
    ErrorCode,
    Result,
    Status,
    decode_result,
    encode_request,
    topics_for,
)
from tests.integration.harness import (
    WorkerProcess,
    create_model_topics,
    read_topic,
    until,
    wait_for_results,
)

FAULTY = "tests.faults.faulty:FaultyDigits"
STREAMS = 4
FPS = 40  # per stream: 160 frames/s against at most 80 served
SECONDS = 6
MAX_AGE_S = 1.0  # freshest mode: about 3 batch times plus transport; see the module doc


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
        ("--max-batch-size", "4"),
        FAULTY,
        {"CONVEYOR_TEST_SLOW_MS": "50"},
    )
    yield process
    process.stop()


async def send_live(
    bootstrap: str, topic: str, model: str, png: bytes, supersede: bool
) -> list[str]:
    """STREAMS streams of FPS frames a second each, for SECONDS, paced by the clock."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    ids: list[str] = []
    pending = []
    try:
        start = time.monotonic()
        for seq in range(FPS * SECONDS):
            for k in range(STREAMS):
                stream = f"{model}-s{k}"
                record = encode_request(
                    png,
                    request_id=f"{stream}:{seq}",
                    content_type=ContentType.PNG,
                    source="camera",
                    stream=stream,
                    seq=seq,
                    supersede=supersede,
                )
                pending.append(
                    await producer.send(topic, record.value, key=record.key, headers=record.headers)
                )
                ids.append(f"{stream}:{seq}")
            # The frame clock: live sources do not wait for anyone.
            await asyncio.sleep(max(0.0, start + (seq + 1) / FPS - time.monotonic()))
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return ids


def age_s(result: Result) -> float:
    assert result.timings is not None
    assert result.timings.published_ms is not None
    return (result.timings.published_ms - result.timings.produced_ms) / 1000.0


async def run_streams(
    worker: WorkerProcess,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    png: bytes,
    supersede: bool,
) -> tuple[list[str], dict[str, Result], list[object]]:
    await create_model_topics(kafka_admin, model_name, partitions=2)
    worker.start()
    await until(lambda: "ready: serving" in worker.log(), "the worker is ready", 120, worker.log)
    topics = topics_for(model_name)
    ids = await send_live(kafka_bootstrap, topics.requests, model_name, png, supersede)
    results = await wait_for_results(redis_url, ids, 120)
    assert len(results) == len(ids), worker.log()[-3000:]  # every frame ends with a result
    replies = await read_topic(kafka_bootstrap, topics.results, len(ids), 60)
    return ids, results, replies


@pytest.mark.timeout(240)
async def test_freshest_frames_keep_answered_frames_young(
    worker: WorkerProcess,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digit_png: bytes,
) -> None:
    ids, results, replies = await run_streams(
        worker, kafka_admin, kafka_bootstrap, redis_url, model_name, digit_png, supersede=True
    )
    ok = [r for r in results.values() if r.status is Status.ok]
    superseded = [r for r in results.values() if r.status is not Status.ok]
    for result in superseded:
        assert result.status is Status.expired
        assert result.error is not None
        assert result.error.code == ErrorCode.superseded
    ages = sorted(age_s(r) for r in ok)
    print(
        f"{len(ids)} frames: {len(ok)} ok, {len(superseded)} superseded; ok frames' age "
        f"median {ages[len(ages) // 2] * 1000:.0f} ms, max {ages[-1] * 1000:.0f} ms"
    )
    assert ok
    assert superseded
    assert ages[-1] <= MAX_AGE_S
    # The stream's answered frames come in frame order on the reply topic, once each.
    seen: dict[str, list[int]] = defaultdict(list)
    for record in replies:
        document = decode_result(record.value)
        if document.status is Status.ok:
            stream, seq = document.id.rsplit(":", 1)
            seen[stream].append(int(seq))
    assert len(seen) == STREAMS
    for seqs in seen.values():
        assert seqs == sorted(set(seqs))
    assert sum(len(seqs) for seqs in seen.values()) == len(ok)


@pytest.mark.timeout(240)
async def test_without_the_mode_every_frame_runs_and_the_age_grows(
    worker: WorkerProcess,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digit_png: bytes,
) -> None:
    ids, results, _ = await run_streams(
        worker, kafka_admin, kafka_bootstrap, redis_url, model_name, digit_png, supersede=False
    )
    assert all(r.status is Status.ok for r in results.values())
    last = [results[i] for i in ids[-STREAMS:]]
    oldest = max(age_s(r) for r in last)
    print(f"without freshest-frame mode the last frames were {oldest:.1f} s old when answered")
    assert oldest > 2 * MAX_AGE_S
