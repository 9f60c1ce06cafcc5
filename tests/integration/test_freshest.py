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

from collections import defaultdict
from collections.abc import Awaitable, Callable

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, Reply, produce_at_rate, read_topic, wait_for_results
from schemas import (
    ContentType,
    ErrorCode,
    OutgoingRecord,
    Result,
    Status,
    decode_result,
    encode_request,
    topics_for,
)
from tests.faults import faulty

STREAMS = 4
FPS = 40  # per stream: 160 frames/s against at most 80 served
SECONDS = 6
MAX_AGE_S = 1.0  # freshest mode: about 3 batch times plus transport; see the module doc


def live_frames(model: str, png: bytes, supersede: bool) -> tuple[list[OutgoingRecord], list[str]]:
    """STREAMS streams of FPS * SECONDS frames, interleaved in the order a clock sends them;
    and their request ids."""
    streams = [(f"{model}-s{k}", seq) for seq in range(FPS * SECONDS) for k in range(STREAMS)]
    records = [
        encode_request(
            png,
            request_id=f"{stream}:{seq}",
            content_type=ContentType.PNG,
            source="camera",
            stream=stream,
            seq=seq,
            supersede=supersede,
        )
        for stream, seq in streams
    ]
    return records, [f"{stream}:{seq}" for stream, seq in streams]


def age_s(result: Result) -> float:
    assert result.timings is not None
    assert result.timings.published_ms is not None
    return (result.timings.published_ms - result.timings.produced_ms) / 1000.0


Served = tuple[list[str], dict[str, Result], list[Reply]]
"""The frames' request ids, their results by id, and the reply topic's records."""
RunStreams = Callable[[bool], Awaitable[Served]]


@pytest.fixture
def run_streams(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> RunStreams:
    """``run_streams(supersede)``: a slow worker (at most 80 frames/s) serving the live
    streams (160 frames/s), with or without the freshest-frame mode."""

    async def run(supersede: bool) -> Served:
        await create_model_topics(client_settings, model_name, partitions=2)
        slow = {"CONVEYOR_TEST_SLOW_MS": "50"}
        worker = workers.start("--max-batch-size", "4", model=faulty.SPEC, env=slow)
        await worker.until_serving(120)
        topics = topics_for(model_name)
        frames, ids = live_frames(model_name, digits[0][0], supersede)
        # The frame clock: live sources do not wait for anyone.
        await produce_at_rate(kafka_bootstrap, topics.requests, frames, STREAMS * FPS)
        results = await wait_for_results(redis_url, ids, 120)
        assert len(results) == len(ids), worker.log()[-3000:]  # every frame ends with a result
        replies = await read_topic(kafka_bootstrap, topics.results, len(ids), 60)
        return ids, results, replies

    return run


@pytest.mark.timeout(240)
async def test_freshest_frames_keep_answered_frames_young(run_streams: RunStreams) -> None:
    ids, results, replies = await run_streams(True)
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
    run_streams: RunStreams,
) -> None:
    ids, results, _ = await run_streams(False)
    assert all(r.status is Status.ok for r in results.values())
    last = [results[i] for i in ids[-STREAMS:]]
    oldest = max(age_s(r) for r in last)
    print(f"without freshest-frame mode the last frames were {oldest:.1f} s old when answered")
    assert oldest > 2 * MAX_AGE_S
