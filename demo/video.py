"""The video demo: digits moving on a canvas, detected frame by frame through Kafka.

``python -m demo.video`` (what ``make demo-video`` runs after ``make up``):

1. builds the demo detector (``demo.models.detector``) unless it is cached;
2. draws a video of held-out digits (never trained on) bouncing around a 160x120
   canvas, one per quarter, each replaced by another every two seconds, and writes
   it as an H.264 MP4, remembering every digit's true box in every frame
   (``demo.footage``);
3. creates the model's topics and starts ``conveyor worker --model
   demo.models.detector:DigitsDetector`` as a child process;
4. sends the video with ``conveyor stream --wait`` (every frame as a JPEG request of
   one stream) and reads the results back in frame order, as that command prints them;
5. draws each frame's boxes, labels and scores on the decoded video and writes an
   animated GIF and one frame as a PNG;
6. prints frames/s, latency and how well the boxes match the truth, then stops the
   worker (SIGTERM, then waits for it to drain), also on Ctrl-C or error.

It exits with status 1 when fewer than ``MIN_RECALL`` of the digits are found with
the right label, or when any frame's result is missing or not ``ok``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from demo.footage import FPS, Truth, annotate, detections, make_video
from demo.models.detector import build_detector, detector_metadata, match
from demo.models.scenes import CANVAS
from demo.worker import REPO, DemoError, client_settings, exit_status, launch, worker_config
from producers import AsyncClient, ClientSettings, Status
from producers.admin import create_model_topics
from schemas import ContentType, Result, Timings, decode_result

MIN_RECALL = 0.7
"""The share of true digits the served boxes must find (IoU >= 0.5, right label)."""
_PARTITIONS = 2


@dataclass(frozen=True)
class VideoReport:
    """What a video demo run measured."""

    frames: int  # frames sent (and results read back)
    ok: int  # frames whose result is ok
    digits: int  # true digits over all frames
    found: int  # of them, found by a box with IoU >= 0.5 and the right label
    boxes: int  # boxes reported over all frames
    frames_per_s: float  # frames / (last published - first produced)
    latency_p50_ms: float  # produced -> sent to Redis, from each result's timings
    latency_p99_ms: float
    gif: Path
    png: Path

    @property
    def recall(self) -> float:
        return self.found / self.digits if self.digits else 0.0

    @property
    def precision(self) -> float:
        return self.found / self.boxes if self.boxes else 0.0

    @property
    def passed(self) -> bool:
        return self.ok == self.frames and self.recall >= MIN_RECALL


async def run_demo_video(
    settings: ClientSettings,
    model_name: str,
    *,
    frames: int = 100,
    out: Path = REPO / ".run" / "demo-video",
    device: str = "auto",
    wait_s: float = 120.0,
    log_path: Path | None = None,
) -> VideoReport:
    """Serve the demo detector as ``model_name``, stream a video of ``frames`` frames
    through it, and write the annotated GIF and PNG into ``out``."""
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(_describe_detector)
    video = out / "digits.mp4"
    truths = await asyncio.to_thread(make_video, video, frames)
    _say(f"video {video}: {frames} frames of {CANVAS[0]}x{CANVAS[1]} at {FPS} fps")
    states = await create_model_topics(settings, model_name, _PARTITIONS)
    _say(f"topics {', '.join(state.name for state in states)} ready")
    log_path = log_path or REPO / ".run" / f"demo-worker-{model_name}.log"
    detector = "demo.models.detector:DigitsDetector"
    config = worker_config(settings, model_name, detector, device, "--max-batch-size", "16")
    async with launch(config, log_path) as worker:
        _say(f"worker started (pid {worker.pid}); its log: {log_path}")
        await worker.unless_it_dies(_first_answer(settings, model_name, video, wait_s))
        _say("worker ready; streaming the video with `conveyor stream --wait`")
        stream_id = f"digits-{uuid.uuid4().hex[:8]}"
        results = await worker.unless_it_dies(
            _stream(settings, model_name, video, stream_id, wait_s)
        )
    _say("worker stopped")
    gif, png = out / "digits-annotated.gif", out / "digits-frame.png"
    await asyncio.to_thread(annotate, video, results, gif, png)
    report = _report(results, truths, gif, png)
    _print_summary(report)
    return report


def _describe_detector() -> None:
    build_detector()
    meta = detector_metadata()
    _say(
        f"model {meta['version']}: trained in {meta['train_seconds']:.1f} s "
        f"({meta['train_cpu_seconds']:.1f} s of CPU time); on held-out "
        f"scenes it finds {meta['heldout_recall']:.1%} of the digits at "
        f"{meta['heldout_precision']:.1%} precision"
    )


async def _first_answer(settings: ClientSettings, model: str, video: Path, wait_s: float) -> None:
    """Submit the video's first frame and wait: the worker has loaded and joined its group."""
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


def _report(
    results: Sequence[Result | None], truths: Sequence[Truth], gif: Path, png: Path
) -> VideoReport:
    found = boxes = 0
    for result, truth in zip(results, truths, strict=False):
        served = detections(result)
        boxes += len(served)
        found += match([d["box"] for d in served], [d["index"] for d in served], truth)
    done = [r for r in results if r is not None]
    spans = [r.timings for r in done if r.timings is not None]
    latencies = sorted(_durable_ms(t) - t.produced_ms for t in spans)
    elapsed_s = (
        (max(_durable_ms(t) for t in spans) - min(t.produced_ms for t in spans)) / 1000
        if spans
        else math.nan
    )
    return VideoReport(
        frames=len(truths),
        ok=sum(r.status is Status.ok for r in done),
        digits=sum(len(truth) for truth in truths),
        found=found,
        boxes=boxes,
        frames_per_s=len(done) / elapsed_s if elapsed_s > 0 else math.nan,
        latency_p50_ms=statistics.median(latencies) if latencies else math.nan,
        latency_p99_ms=latencies[max(math.ceil(0.99 * len(latencies)), 1) - 1]
        if latencies
        else math.nan,
        gif=gif,
        png=png,
    )


def _durable_ms(timings: Timings) -> float:
    """When the result was sent to Redis (durable one round trip later)."""
    return timings.finished_ms if timings.published_ms is None else timings.published_ms


def _print_summary(report: VideoReport) -> None:
    verdict = "OK" if report.passed else f"FAILED: below {MIN_RECALL:.0%} or frames not ok"
    print(
        f"\n{report.ok}/{report.frames} frames answered ok, in order; found {report.found} of "
        f"{report.digits} digits ({report.recall:.1%}) with {report.boxes} boxes "
        f"({report.precision:.1%} right): {verdict}\n"
        f"throughput {report.frames_per_s:.1f} frames/s, latency p50 "
        f"{report.latency_p50_ms:.1f} ms, p99 {report.latency_p99_ms:.1f} ms "
        "(from each result's produced and published times: to durability in Redis)\n"
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
    parser.add_argument("--device", default="auto", help="the worker's device: auto, cpu, cuda")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    parser.add_argument("--worker-log", type=Path, help="the worker's log file")
    parser.add_argument("--kafka-bootstrap", help="[env CONVEYOR_KAFKA_BOOTSTRAP]")
    parser.add_argument("--redis-url", help="[env CONVEYOR_REDIS_URL]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every frame is answered and the boxes find the digits."""
    args = _parser().parse_args(argv)
    demo = run_demo_video(
        client_settings(args.kafka_bootstrap, args.redis_url),
        args.model_name,
        frames=args.frames,
        out=args.out,
        device=args.device,
        wait_s=args.timeout,
        log_path=args.worker_log,
    )
    return exit_status(demo, _say)


if __name__ == "__main__":
    sys.exit(main())
