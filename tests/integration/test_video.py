"""Video streams against the real broker and a real worker process.

A 20-second video is generated here with PyAV, sent as frames of two streams
at once, and the results are read back per stream, in frame order, from the
model's results topic. Tests of ordering and gaps write result records to the
results topic themselves, the way a worker does, to control their order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr

from producers.errors import ResultTimeout, UnknownModel
from producers.settings import ClientSettings
from producers.testing import read_topic
from producers.video import (
    AsyncStreamReader,
    FrameResult,
    StreamReader,
    VideoSource,
    run_stream,
    stream_video,
)
from schemas import Status, encode_result, ok_result, result_headers, topics_for
from tests.conftest import CreateTopic
from tests.videos import collect, every_40_ms, stream_parser, write_video

# One test process runs the module: its served_model worker starts once under pytest -n.
pytestmark = pytest.mark.xdist_group("video")

FRAMES = 200  # 20 s sampled at 10 fps


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 seconds at 25 fps, 64x64: 500 frames."""
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", every_40_ms(20))


@pytest.fixture
def settings(kafka_bootstrap: str, redis_url: str) -> ClientSettings:
    return ClientSettings(kafka_bootstrap=kafka_bootstrap, redis_url=SecretStr(redis_url))


async def send(settings: ClientSettings, video: Path, model: str, stream_id: str) -> int:
    with VideoSource(video, fps=Fraction(10)) as source:
        return await stream_video(settings, source, model=model, stream_id=stream_id)


def assert_complete_and_ok(stream_id: str, frames: Sequence[FrameResult], count: int) -> None:
    assert [f.seq for f in frames] == list(range(count))
    assert [f.result.id if f.result else None for f in frames] == [
        f"{stream_id}:{n}" for n in range(count)
    ]
    assert {f.result.status if f.result else "missing" for f in frames} == {Status.ok}


@pytest.mark.timeout(120)
async def test_two_interleaved_streams_come_back_complete_and_in_order(
    served_model: str, settings: ClientSettings, video: Path, uid: str, kafka_bootstrap: str
) -> None:
    streams = [f"{uid}-a", f"{uid}-b"]
    # Entered before sending: every result published from here on is seen. The
    # timeout covers the worker's start-up, which this test's first frames wait for.
    async with (
        AsyncStreamReader(settings, served_model, streams[0], timeout=60) as reader_a,
        AsyncStreamReader(settings, served_model, streams[1], timeout=60) as reader_b,
    ):
        sent = await asyncio.gather(*(send(settings, video, served_model, s) for s in streams))
        results = await asyncio.gather(collect(reader_a, FRAMES), collect(reader_b, FRAMES))

    assert sent == [FRAMES, FRAMES]
    for stream_id, frames in zip(streams, results, strict=True):
        assert_complete_and_ok(stream_id, frames, FRAMES)
    # Keyed by stream id: each stream in one partition, frames in ce_seq order.
    records = await read_topic(
        kafka_bootstrap, topics_for(served_model).requests, expect=2 * FRAMES, timeout_s=30
    )
    by_stream: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        headers = dict(record.headers)
        stream_id = headers["ce_stream"].decode()
        by_stream.setdefault(stream_id, []).append((record.partition, int(headers["ce_seq"])))
    for stream_id in streams:
        partitions, seqs = zip(*by_stream[stream_id], strict=True)
        assert len(set(partitions)) == 1
        assert list(seqs) == list(range(FRAMES))


@pytest.mark.timeout(120)
async def test_stream_command_waits_and_prints_results_in_frame_order(
    served_model: str,
    settings: ClientSettings,
    video: Path,
    uid: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = stream_parser().parse_args(
        [
            "stream",
            str(video),
            "--model",
            served_model,
            "--stream-id",
            f"cli-{uid}",
            "--fps",
            "2",
            "--max-frames",
            "12",
            "--size",
            "16x16",
            "--wait",
            "--timeout",
            "60",
        ]
    )

    status = await run_stream(args, settings)

    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 0
    assert [line["seq"] for line in lines] == list(range(12))
    assert [line["id"] for line in lines] == [f"cli-{uid}:{n}" for n in range(12)]
    assert {line["status"] for line in lines} == {"ok"}
    assert f"sent 12 frames of {video}" in err


async def publish_results(bootstrap: str, topic: str, request_ids: Sequence[str]) -> None:
    """Write ok results for ``request_ids`` to ``topic`` in that order, as a worker does."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for request_id in request_ids:
            result = ok_result(request_id, [], model="m", model_version="1", worker="test-worker")
            await producer.send_and_wait(
                topic,
                encode_result(result),
                key=request_id.encode(),
                headers=result_headers(result),
            )
    finally:
        await producer.stop()


async def test_out_of_order_results_are_reordered_and_gaps_reported(
    settings: ClientSettings, create_topic: CreateTopic, model_name: str, kafka_bootstrap: str
) -> None:
    topic = await create_topic(topics_for(model_name).results, partitions=3)
    before = datetime.now(UTC) - timedelta(seconds=1)
    # Frame 2 never comes; frame 1 comes twice (a redelivery); another stream interleaves.
    order = ["s:3", "s:1", "other:0", "s:0", "s:1", "s:5", "s:4", "other:1"]
    await publish_results(kafka_bootstrap, topic, order)

    # Published before the reader started: `since` finds them.
    async with AsyncStreamReader(settings, model_name, "s", since=before, timeout=1.5) as reader:
        frames = await collect(reader, 6)
        with pytest.raises(ResultTimeout, match="s:6"):
            await collect(reader, 1)

    assert [(f.seq, f.missing) for f in frames] == [
        (0, False),
        (1, False),
        (2, True),
        (3, False),
        (4, False),
        (5, False),
    ]
    assert [f.request_id for f in frames] == [f"s:{n}" for n in range(6)]


@pytest.fixture
async def results_topic(create_topic: CreateTopic, model_name: str) -> str:
    return await create_topic(topics_for(model_name).results, partitions=2)


def test_sync_reader_starts_at_start_seq(
    settings: ClientSettings, results_topic: str, model_name: str, kafka_bootstrap: str
) -> None:
    # A plain (not async) test: the sync reader runs its own event loop.
    with StreamReader(settings, model_name, "cam", start_seq=10, timeout=10) as reader:
        # Published after the reader started; 9 is before start_seq and skipped.
        ids = [f"cam:{n}" for n in (12, 9, 11, 10)]
        asyncio.run(publish_results(kafka_bootstrap, results_topic, ids))
        seqs = [f.seq for f in reader.results(3)]

    assert seqs == [10, 11, 12]


async def test_an_unknown_model_is_refused_before_anything_is_sent(
    settings: ClientSettings, model_name: str, video: Path
) -> None:
    with pytest.raises(UnknownModel, match=model_name):
        await send(settings, video, model_name, "cam1")
    with pytest.raises(UnknownModel, match=model_name):
        async with AsyncStreamReader(settings, model_name, "cam1"):
            pass
