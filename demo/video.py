"""The video demo: digits moving on a canvas, detected frame by frame through Kafka,
each detected box then read by a second model (a pipeline of two models).

``python -m demo.video`` (what ``make demo-video`` runs after ``make up``):

1. builds the demo detector (``demo.models.detector``) and the digits classifier
   (``demo.models.digits``) unless they are cached;
2. draws a video of held-out digits (never trained on) bouncing around a 160x120
   canvas, one per quarter, each replaced by another every two seconds, and writes
   it as an H.264 MP4, remembering every digit's true box in every frame
   (``demo.footage``);
3. creates both models' topics (the detector's, and the reader's: the classifier,
   served as ``<model name>-reader``) and starts two child processes: ``conveyor
   worker --model digits`` for the reader, then ``conveyor worker --model
   demo.models.detector:DigitsDetector --then <reader> --then-options ...``, which
   sends a crop of every box it finds to the reader;
4. sends the video with ``conveyor stream --wait`` (every frame as a JPEG request of
   one stream) and reads the results back in frame order, as that command prints
   them: each one the detector's answer with every box's reading under ``next``;
5. draws each frame's boxes, the detector's labels and scores, and the reader's
   labels and scores beside them on the decoded video, and writes an animated GIF
   and one frame as a PNG;
6. prints frames/s, latency, how well the boxes match the truth and how often the
   reader's labels agree with the detector's and with the truth, then stops both
   workers (SIGTERM, then waits for each to drain: the detector first), also on
   Ctrl-C or error.

It exits with status 1 when fewer than ``MIN_RECALL`` of the digits are found with
the right label, when any frame's result is missing or not ``ok``, or when any box
has no reading (its ``next`` missing or not ``ok``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from demo.footage import FPS, Truth, annotate, detections, make_video, reading
from demo.models.detector import (
    SCORE_THRESHOLD,
    build_detector,
    detector_metadata,
    iou,
    match,
)
from demo.models.digits import build_digits_model, digits_metadata
from demo.models.scenes import CANVAS
from demo.worker import (
    REPO,
    DemoError,
    client_settings,
    durable_ms,
    exit_status,
    launch,
    worker_config,
)
from producers import AsyncClient, ClientSettings, Status
from producers.admin import create_model_topics
from producers.testing import unless_one_exits
from schemas import ContentType, Result, decode_result

MIN_RECALL = 0.7
"""The share of true digits the served boxes must find (IoU >= 0.5, right label)."""
DETECTOR = "demo.models.detector:DigitsDetector"
READER = "digits"
"""The second model: the digits classifier, reading each box's crop."""
THEN_OPTIONS = orjson.dumps({"min_score": SCORE_THRESHOLD, "margin": 0.1}).decode()
"""Every box the detector reports goes to the reader (its own threshold is the same)."""
_PARTITIONS = 2


@dataclass(frozen=True)
class VideoReport:
    """What a video demo run measured."""

    frames: int  # frames sent (and results read back)
    ok: int  # frames whose result is ok
    digits: int  # true digits over all frames
    found: int  # of them, found by a box with IoU >= 0.5 and the right label
    boxes: int  # boxes reported over all frames
    read: int  # of them, read by the second model (their ``next`` is ok)
    agree: int  # of those, the reader's label is the detector's
    on_digits: int  # boxes on a distinct true digit (IoU >= 0.5, whatever their label)
    read_right: int  # of them, the reader's label is the digit's
    frames_per_s: float  # frames / (last published - first produced): both stages
    latency_p50_ms: float  # produced -> the parent's result sent, from its timings
    latency_p99_ms: float
    stream_s: float  # `conveyor stream --wait` from its start to its exit: both stages
    gif: Path
    png: Path

    @property
    def recall(self) -> float:
        return self.found / self.digits if self.digits else 0.0

    @property
    def precision(self) -> float:
        return self.found / self.boxes if self.boxes else 0.0

    @property
    def agreement(self) -> float:
        """How often the reader's label is the detector's, over the boxes it read."""
        return self.agree / self.read if self.read else 0.0

    @property
    def read_accuracy(self) -> float:
        """How often the reader's label is the true digit, over the boxes on a digit."""
        return self.read_right / self.on_digits if self.on_digits else 0.0

    @property
    def passed(self) -> bool:
        return self.ok == self.frames and self.recall >= MIN_RECALL and self.read == self.boxes


async def run_demo_video(
    settings: ClientSettings,
    model_name: str,
    *,
    frames: int = 100,
    out: Path = REPO / ".run" / "demo-video",
    device: str = "auto",
    wait_s: float = 120.0,
    log_path: Path | None = None,
    reader_log_path: Path | None = None,
) -> VideoReport:
    """Serve the demo detector as ``model_name`` with the digits classifier reading its
    boxes as ``<model_name>-reader``, stream a video of ``frames`` frames through the
    pair, and write the annotated GIF and PNG into ``out``."""
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(_describe_models)
    video = out / "digits.mp4"
    truths = await asyncio.to_thread(make_video, video, frames)
    _say(f"video {video}: {frames} frames of {CANVAS[0]}x{CANVAS[1]} at {FPS} fps")
    reader = f"{model_name}-reader"
    for name in (model_name, reader):  # the reader's before the detector's worker starts
        states = await create_model_topics(settings, name, _PARTITIONS)
        _say(f"topics {', '.join(state.name for state in states)} ready")
    log_path = log_path or REPO / ".run" / f"demo-worker-{model_name}.log"
    reader_log_path = reader_log_path or REPO / ".run" / f"demo-worker-{reader}.log"
    detector_config = worker_config(
        settings, model_name, DETECTOR, device, "--max-batch-size", "16",
        "--then", reader, "--then-options", THEN_OPTIONS,
    )  # fmt: skip
    reader_config = worker_config(settings, reader, READER, device)
    # Stopped in reverse order: the detector drains while the reader still answers its crops.
    async with (
        launch(reader_config, reader_log_path) as second,
        launch(detector_config, log_path) as first,
    ):
        _say(f"reader {reader} started (pid {second.pid}); its log: {reader_log_path}")
        _say(f"detector {model_name} started (pid {first.pid}); its log: {log_path}")
        workers = (first, second)
        await unless_one_exits(workers, _first_answer(settings, model_name, video, wait_s))
        _say("both workers ready; streaming the video with `conveyor stream --wait`")
        stream_id = f"digits-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        results = await unless_one_exits(
            workers, _stream(settings, model_name, video, stream_id, wait_s)
        )
        stream_s = time.monotonic() - started
    _say("both workers stopped")
    gif, png = out / "digits-annotated.gif", out / "digits-frame.png"
    await asyncio.to_thread(annotate, video, results, gif, png)
    report = _report(results, truths, stream_s, gif, png)
    _print_summary(report, reader)
    return report


def _describe_models() -> None:
    build_detector()
    meta = detector_metadata()
    _say(
        f"detector {meta['version']}: trained in {meta['train_seconds']:.1f} s "
        f"({meta['train_cpu_seconds']:.1f} s of CPU time); on held-out "
        f"scenes it finds {meta['heldout_recall']:.1%} of the digits at "
        f"{meta['heldout_precision']:.1%} precision"
    )
    build_digits_model()
    meta = digits_metadata()
    _say(
        f"reader {meta['version']}: trained in {meta['train_seconds']:.1f} s; on held-out "
        f"digits it reads {meta['heldout_accuracy']:.1%} right"
    )


async def _first_answer(settings: ClientSettings, model: str, video: Path, wait_s: float) -> None:
    """Submit the video's first frame and wait: both workers have loaded and joined their
    groups (the answer waits for the reader's readings of its boxes)."""
    async with AsyncClient(settings) as client:
        request_id = await client.submit(
            _first_frame_jpeg(video), model=model, content_type=ContentType.JPEG
        )
        await client.wait(request_id, wait_s)


def _first_frame_jpeg(video: Path) -> bytes:
    import io

    import av

    with av.open(str(video)) as container:
        frame = next(container.decode(video=0))
        buffer = io.BytesIO()
        frame.to_image().save(buffer, format="JPEG", quality=90)  # type: ignore[no-untyped-call]
        return buffer.getvalue()


async def _stream(
    settings: ClientSettings, model: str, video: Path, stream_id: str, wait_s: float
) -> list[Result | None]:
    """``conveyor stream VIDEO --wait``: one JSON line per frame, in order, parsed."""
    argv = [
        sys.executable, "-m", "producers.cli", "stream", str(video),
        "--model", model, "--stream-id", stream_id, "--wait", "--timeout", str(wait_s),
        "--no-progress", "--kafka-bootstrap", settings.kafka_bootstrap,
        "--redis-url", settings.redis_url.get_secret_value(),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO
    )
    stdout, stderr = await process.communicate()
    if process.returncode not in (0, 1):  # 1: some frame was not ok, which the report shows
        raise DemoError(
            f"conveyor stream exited with status {process.returncode}: "
            f"{stderr.decode(errors='replace').strip()}"
        )
    results: list[Result | None] = []
    for line in stdout.splitlines():
        document = orjson.loads(line)
        document.pop("seq")
        results.append(None if document.get("status") == "missing" else _result(document))
    _say(stderr.decode(errors="replace").strip())
    return results


def _result(document: dict[str, Any]) -> Result:
    return decode_result(orjson.dumps(document))


@dataclass
class _Boxes:
    """Counts over the served boxes of all frames (``VideoReport``'s fields of that name)."""

    found: int = 0
    boxes: int = 0
    read: int = 0
    agree: int = 0
    on_digits: int = 0
    read_right: int = 0

    def add(self, served: Sequence[dict[str, Any]], truth: Truth) -> None:
        """Count one frame's boxes against its true digits."""
        self.boxes += len(served)
        self.found += match([d["box"] for d in served], [d["index"] for d in served], truth)
        readings = [reading(d) for d in served]
        self.read += sum(r is not None for r in readings)
        self.agree += sum(
            r is not None and r["label"] == d["label"]
            for d, r in zip(served, readings, strict=True)
        )
        for n, digit in _on_digits(served, truth):
            read = readings[n]
            self.on_digits += 1
            self.read_right += read is not None and read["index"] == digit


def _on_digits(served: Sequence[dict[str, Any]], truth: Truth) -> list[tuple[int, int]]:
    """The boxes on a distinct true digit (IoU >= 0.5, whatever their label), best box
    first, as ``(index in served, digit)``: ``match``'s pairing, without the label."""
    unmatched = list(truth)
    pairs = []
    for n, detection in enumerate(served):
        box = detection["box"]
        best = max(unmatched, key=lambda t: iou(box, t[:4]), default=None)
        if best is not None and iou(box, best[:4]) >= 0.5:
            unmatched.remove(best)
            pairs.append((n, best[4]))
    return pairs


def _report(
    results: Sequence[Result | None],
    truths: Sequence[Truth],
    stream_s: float,
    gif: Path,
    png: Path,
) -> VideoReport:
    counts = _Boxes()
    for result, truth in zip(results, truths, strict=False):
        counts.add(detections(result), truth)
    done = [r for r in results if r is not None]
    spans = [r.timings for r in done if r.timings is not None]
    latencies = sorted(durable_ms(t) - t.produced_ms for t in spans)
    elapsed_s = (
        (max(durable_ms(t) for t in spans) - min(t.produced_ms for t in spans)) / 1000
        if spans
        else math.nan
    )
    return VideoReport(
        frames=len(truths),
        ok=sum(r.status is Status.ok for r in done),
        digits=sum(len(truth) for truth in truths),
        found=counts.found,
        boxes=counts.boxes,
        read=counts.read,
        agree=counts.agree,
        on_digits=counts.on_digits,
        read_right=counts.read_right,
        frames_per_s=len(done) / elapsed_s if elapsed_s > 0 else math.nan,
        latency_p50_ms=statistics.median(latencies) if latencies else math.nan,
        latency_p99_ms=latencies[max(math.ceil(0.99 * len(latencies)), 1) - 1]
        if latencies
        else math.nan,
        stream_s=stream_s,
        gif=gif,
        png=png,
    )


def _print_summary(report: VideoReport, reader: str) -> None:
    verdict = (
        "OK"
        if report.passed
        else f"FAILED: below {MIN_RECALL:.0%}, frames not ok or boxes not read"
    )
    print(
        f"\n{report.ok}/{report.frames} frames answered ok, in order; found {report.found} of "
        f"{report.digits} digits ({report.recall:.1%}) with {report.boxes} boxes "
        f"({report.precision:.1%} right); {report.read}/{report.boxes} boxes read by "
        f"{reader}: {verdict}\n"
        f"the reader agrees with the detector on {report.agree} of {report.read} boxes "
        f"({report.agreement:.1%}) and with the truth on {report.read_right} of "
        f"{report.on_digits} boxes on a digit ({report.read_accuracy:.1%})\n"
        f"through both stages {report.frames_per_s:.1f} frames/s, latency p50 "
        f"{report.latency_p50_ms:.1f} ms, p99 {report.latency_p99_ms:.1f} ms "
        "(from each result's produced and published times: every box read)\n"
        f"both stages: {report.frames} frames sent and answered in {report.stream_s:.1f} s "
        f"({report.frames / report.stream_s:.1f} frames/s: `conveyor stream --wait` from "
        "start to exit)\n"
        f"annotated video: {report.gif}\none frame: {report.png}",
        flush=True,
    )


def _say(message: str) -> None:
    print(f"[demo-video] {message}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo.video", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-name", default="digits-detector-demo", help="name in topics")
    parser.add_argument("--frames", type=int, default=100, help="frames in the video")
    parser.add_argument("--out", type=Path, default=REPO / ".run" / "demo-video")
    parser.add_argument("--device", default="auto", help="the workers' device: auto, cpu, cuda")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    parser.add_argument("--worker-log", type=Path, help="the detector worker's log file")
    parser.add_argument("--reader-log", type=Path, help="the reader worker's log file")
    parser.add_argument("--kafka-bootstrap", help="[env CONVEYOR_KAFKA_BOOTSTRAP]")
    parser.add_argument("--redis-url", help="[env CONVEYOR_REDIS_URL]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every frame is answered, the boxes find the digits and every
    box is read."""
    args = _parser().parse_args(argv)
    demo = run_demo_video(
        client_settings(args.kafka_bootstrap, args.redis_url),
        args.model_name,
        frames=args.frames,
        out=args.out,
        device=args.device,
        wait_s=args.timeout,
        log_path=args.worker_log,
        reader_log_path=args.reader_log,
    )
    return exit_status(demo, _say)


if __name__ == "__main__":
    sys.exit(main())
