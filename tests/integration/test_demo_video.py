"""``make demo-video``'s path end to end: a video, a worker process, ``conveyor stream``,
results in frame order, and the annotated output."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from PIL import Image

from demo.models.detector import build_detector
from demo.video import main
from schemas import topics_for

_SUMMARY = re.compile(r"(\d+)/(\d+) frames answered ok, in order; found (\d+) of (\d+) digits")
FRAMES = 30


@pytest.fixture
async def demo_model(kafka_admin: AIOKafkaAdminClient, model_name: str) -> AsyncIterator[str]:
    """The demo's model name; its topics are deleted afterwards."""
    yield model_name
    topics = topics_for(model_name)
    await kafka_admin.delete_topics([topics.requests, topics.results, topics.dlq])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_video_detects_the_digits_and_writes_the_annotated_video(
    kafka_bootstrap: str,
    redis_url: str,
    demo_model: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build_detector()  # trained once per machine (about a minute), cached after
    argv = ["--model-name", demo_model, "--device", "cpu", "--frames", str(FRAMES)]
    argv += ["--out", str(tmp_path), "--worker-log", str(tmp_path / "worker.log")]
    status = main([*argv, "--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url])

    out = capsys.readouterr().out
    assert status == 0, out
    summary = _SUMMARY.search(out)
    assert summary is not None, out
    ok, frames, found, digits = (int(group) for group in summary.groups())
    assert ok == frames == FRAMES
    assert digits == 4 * FRAMES  # four digits on screen in every frame
    assert found >= 0.7 * digits
    assert "frames/s" in out
    assert "latency p50" in out
    with Image.open(tmp_path / "digits-annotated.gif") as gif:
        assert gif.n_frames == FRAMES
        assert gif.size == (480, 360)
    with Image.open(tmp_path / "digits-frame.png") as png:
        assert png.size == (480, 360)
