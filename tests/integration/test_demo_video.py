"""``make demo-video``'s path end to end: a video, a pipeline of two worker processes (the
detector, and the classifier reading each of its boxes), ``conveyor stream``, results in
frame order with every box read, and the annotated output."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
import pytest
from PIL import GifImagePlugin, Image

from demo.video import main
from producers.testing import read_topic
from producers.video.ids import parse_frame_request_id
from schemas import topics_for

_SUMMARY = re.compile(
    r"(\d+)/(\d+) frames answered ok, in order; found (\d+) of (\d+) digits "
    r"\([\d.]+%\) with (\d+) boxes \([\d.]+% right\); (\d+)/(\d+) boxes read by (\S+): OK"
)
_AGREEMENT = re.compile(
    r"the reader agrees with the detector on (\d+) of (\d+) boxes \([\d.]+%\) "
    r"and with the truth on (\d+) of (\d+) boxes on a digit \([\d.]+%\)"
)
FRAMES = 30


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_video_detects_and_reads_the_digits_and_writes_the_annotated_video(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    detector: Path,  # trained once per machine (about a minute), cached after
    digits: list[tuple[bytes, int]],  # the classifier, built (cached) before its worker loads it
) -> None:
    reader = f"{model_name}-reader"
    drop_topics.extend([model_name, reader])  # the demo creates them
    argv = ["--model-name", model_name, "--device", "cpu", "--frames", str(FRAMES)]
    argv += ["--out", str(tmp_path), "--worker-log", str(tmp_path / "worker.log")]
    argv += ["--reader-log", str(tmp_path / "reader.log")]
    status = main([*argv, "--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url])

    out = capsys.readouterr().out
    assert status == 0, out
    summary = _SUMMARY.search(out)
    assert summary is not None, out
    ok, frames, found, digits_shown, boxes, read, read_of = (
        int(group) for group in summary.groups()[:7]
    )
    assert summary.group(8) == reader
    assert ok == frames == FRAMES
    assert digits_shown == 4 * FRAMES  # four digits on screen in every frame
    assert found >= 0.7 * digits_shown
    assert read == read_of == boxes  # every box read by the second model
    agreement = _AGREEMENT.search(out)
    assert agreement is not None, out
    agree, agree_of, right, on_digits = (int(group) for group in agreement.groups())
    assert agree_of == read
    assert agree >= 0.7 * read  # the two models mostly see the same digit in a box
    assert found <= on_digits <= boxes
    assert right >= 0.7 * on_digits  # crops cut where the digits are
    assert "frames/s" in out
    assert "latency p50" in out
    assert "both stages:" in out
    assert (tmp_path / "reader.log").stat().st_size > 0
    check_results_topic(kafka_bootstrap, model_name, reader)
    with Image.open(tmp_path / "digits-annotated.gif") as gif:
        assert isinstance(gif, GifImagePlugin.GifImageFile)
        assert gif.n_frames == FRAMES
        assert gif.size == (480, 360)
    with Image.open(tmp_path / "digits-frame.png") as png:
        assert png.size == (480, 360)


def check_results_topic(kafka_bootstrap: str, model: str, reader: str) -> None:
    """Every answer on the detector's results topic (the first frame's, as the demo waits
    for the workers, then each frame's) is ok, and each of its boxes carries the reader's
    ok answer under ``next``."""
    topic = topics_for(model).results
    records = asyncio.run(read_topic(kafka_bootstrap, topic, expect=FRAMES + 1, timeout_s=60))
    seqs = set()
    for record in records:
        result = orjson.loads(record.value)
        assert result["status"] == "ok", result
        detections = result["outputs"]["detections"]
        assert result["outputs"]["pipeline"] == {
            "model": reader,
            "children": len(detections),
            "failed": [],
        }
        for detection in detections:
            then = detection["next"]
            assert then["model"] == reader
            assert then["status"] == "ok", then
            assert then["outputs"][0]["label"] == str(then["outputs"][0]["index"])
        frame = parse_frame_request_id(result["id"])
        if frame is not None:
            seqs.add(frame[1])
    assert seqs == set(range(FRAMES))  # one answer a frame
