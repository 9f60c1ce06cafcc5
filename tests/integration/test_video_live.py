"""Live sources and real-time play against the real broker and a real worker process.

The live source is ``tests.live_video.LiveVideoServer``, an HTTP server started
here that sends an endless MPEG-TS stream at 25 frames a second, as a camera or
a streaming server does; stopping it mid-stream is a camera dropping off the
network.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import SecretStr

from producers.settings import ClientSettings
from producers.testing import free_port, read_topic, until
from producers.video import (
    AsyncStreamReader,
    LiveSource,
    SentFrame,
    VideoSource,
    run_stream,
    stream_video,
)
from schemas import Status, topics_for
from tests.conftest import CreateTopic
from tests.live_video import LiveVideoServer
from tests.videos import collect, every_40_ms, stream_parser, write_video

# One test process runs the module: its served_model worker starts once under pytest -n.
pytestmark = pytest.mark.xdist_group("video-live")

OUTAGE_S = 1.5  # how long the source is down


@pytest.fixture
def settings(kafka_bootstrap: str, redis_url: str) -> ClientSettings:
    return ClientSettings(kafka_bootstrap=kafka_bootstrap, redis_url=SecretStr(redis_url))


def capture_times(records: list[dict[str, bytes]]) -> list[datetime]:
    return [datetime.fromisoformat(r["ce_capturetime"].decode()) for r in records]


async def requests_of(bootstrap: str, model: str, count: int) -> list[dict[str, bytes]]:
    """The headers of the first ``count`` records of ``model``'s request topic, in order."""
    records = await read_topic(bootstrap, topics_for(model).requests, expect=count, timeout_s=30)
    assert len({r.partition for r in records}) == 1  # one stream: one partition, in order
    return [dict(r.headers) for r in records]


@pytest.mark.timeout(120)
async def test_a_dropped_live_source_is_reconnected_and_the_gap_reported(
    served_model: str,
    settings: ClientSettings,
    uid: str,
    kafka_bootstrap: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream_id = f"live-{uid}"
    sent: list[SentFrame] = []
    server = LiveVideoServer(free_port())
    server.start()
    try:
        with LiveSource(server.url, max_frames=75, reconnect_for=30) as source:
            async with AsyncStreamReader(settings, served_model, stream_id, timeout=60) as reader:
                sending = asyncio.create_task(
                    stream_video(
                        settings,
                        source,
                        model=served_model,
                        stream_id=stream_id,
                        on_sent=sent.append,
                    )
                )
                await until(lambda: len(sent) >= 25, "25 frames sent before the drop", 30)
                await asyncio.to_thread(server.stop)
                # The outage itself is the scenario: the source stays away this long.
                await asyncio.sleep(OUTAGE_S)
                await asyncio.to_thread(server.start)
                count = await sending
                frames = await collect(reader, count)
    finally:
        server.stop()

    assert count == 75
    assert server.connections == 2
    [gap] = source.gaps
    assert gap.seconds >= OUTAGE_S
    assert 25 <= gap.after_seq + 1 < 75
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"dropped after frame {gap.after_seq}" in line for line in logged), logged
    assert any("is back after" in line and "reconnection 1" in line for line in logged), logged
    # Every frame reached Kafka once, ce_seq counting on across the reconnection.
    headers = await requests_of(kafka_bootstrap, served_model, 75)
    assert [int(h["ce_seq"]) for h in headers] == list(range(75))
    assert {h["ce_stream"] for h in headers} == {stream_id.encode()}
    # Capture times rise, and the one step across the outage is the gap.
    captured = capture_times(headers)
    steps = [(b - a).total_seconds() for a, b in itertools.pairwise(captured)]
    assert min(steps) >= 0
    assert steps.index(max(steps)) == gap.after_seq
    assert max(steps) >= OUTAGE_S
    assert [f.captured for f in sent] == captured
    # And the worker answered every frame, in order.
    assert [f.seq for f in frames] == list(range(75))
    assert {f.result.status if f.result else "missing" for f in frames} == {Status.ok}


@pytest.mark.timeout(60)
async def test_realtime_play_sends_each_frame_at_its_presentation_time(
    settings: ClientSettings,
    create_topic: CreateTopic,
    model_name: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    await create_topic(topics_for(model_name).requests, partitions=1)
    video = write_video(tmp_path / "two-seconds.mp4", every_40_ms(2))  # 50 frames, 1.96 s

    started = time.monotonic()
    with VideoSource(video, realtime=True) as source:
        count = await stream_video(settings, source, model=model_name, stream_id="clip")
    elapsed = time.monotonic() - started

    assert count == 50
    assert elapsed >= 1.8
    records = await read_topic(
        kafka_bootstrap, topics_for(model_name).requests, expect=50, timeout_s=30
    )
    headers = [dict(r.headers) for r in records]
    captured = capture_times(headers)
    # Each frame is stamped with its presentation time on the wall clock...
    offsets = [(c - captured[0]).total_seconds() for c in captured]
    assert offsets == pytest.approx([n * 0.04 for n in range(50)], abs=1e-3)
    # ... and never leaves before it (the record timestamp is when it was sent).
    for record, at in zip(records, captured, strict=True):
        assert record.timestamp >= at.timestamp() * 1000 - 2, record
        assert datetime.fromisoformat(dict(record.headers)["ce_time"].decode()) >= at


@pytest.mark.timeout(90)
async def test_stream_command_reads_a_live_url_and_waits_for_the_results(
    served_model: str,
    settings: ClientSettings,
    uid: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["stream", "URL", "--model", served_model, "--stream-id", f"cli-live-{uid}"]
    with LiveVideoServer(free_port()) as server:
        argv[1] = server.url
        args = stream_parser().parse_args(
            [*argv, "--fps", "10", "--max-frames", "15", "--wait", "--timeout", "60"]
        )
        status = await run_stream(args, settings)

    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 0
    assert [line["seq"] for line in lines] == list(range(15))
    assert {line["status"] for line in lines} == {"ok"}
    assert f"sent 15 frames of {server.url}" in err
    assert "(0 reconnections, 0.0 s without frames)" in err
