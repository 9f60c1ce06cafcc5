"""``make demo-video``'s path end to end: a video, a worker process, ``conveyor stream``,
results in frame order, and the annotated output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import GifImagePlugin, Image

from demo.video import main

_SUMMARY = re.compile(r"(\d+)/(\d+) frames answered ok, in order; found (\d+) of (\d+) digits")
FRAMES = 30


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_video_detects_the_digits_and_writes_the_annotated_video(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    detector: Path,  # trained once per machine (about a minute), cached after
) -> None:
    drop_topics.append(model_name)  # the demo creates them
    argv = ["--model-name", model_name, "--device", "cpu", "--frames", str(FRAMES)]
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
        assert isinstance(gif, GifImagePlugin.GifImageFile)
        assert gif.n_frames == FRAMES
        assert gif.size == (480, 360)
    with Image.open(tmp_path / "digits-frame.png") as png:
        assert png.size == (480, 360)
