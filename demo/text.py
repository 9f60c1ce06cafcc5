"""The text demo: classify a stream of product reviews through Kafka, one text a request.

``python -m demo.text`` (what ``make demo-text`` runs after ``make up``):

1. builds the demo's review classifier unless it is cached (``demo.models.reviews``: the
   rule that makes the reviews, the tokenizer and the 2-layer BERT are described there),
   and classifies the held-out reviews with the model run directly through
   transformers: the offline labels;
2. starts ``conveyor worker --model hf:FOLDER --profile latency`` on the CPU as a child
   process and waits for its first answer;
3. streams the held-out reviews to it at a steady rate, each one a ``text/plain``
   request of its own, and waits for every answer;
4. prints the served accuracy beside the offline one, how many served top-1 labels equal
   the offline ones, the largest difference between a served and an offline top-1
   score, and the latency from each request's production to its result's write to Redis;
5. stops the worker (SIGTERM, then waits for it to drain), also on Ctrl-C or error.

It exits with status 1 when more than ``LABEL_TOLERANCE`` served labels differ from the
offline ones: in float32 on the CPU the two paths compute the same logits but for
rounding (the worker pads a text to its length bucket, transformers to the longest text
of its batch), so none should.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from demo.models.reviews import (
    DEFAULT_FOLDER,
    HELD_OUT,
    Reviews,
    accuracy,
    build,
    predict,
    quiet_progress,
)
from demo.models.reviews import reviews as make_reviews
from demo.worker import (
    REPO,
    client_settings,
    collect,
    durable_ms,
    exit_status,
    latency_ms,
    launch,
    percentile,
    stream,
    worker_config,
)
from producers import AsyncClient, ClientSettings, Result, Status
from producers.admin import create_model_topics
from schemas import ContentType

TEXT = ContentType.TEXT  # every request of the stream
RATE = 250  # reviews a second, sent in slices of 5
LABEL_TOLERANCE = 0
"""Served top-1 labels allowed to differ from the offline ones (see the module doc)."""
_PARTITIONS = 2


@dataclass(frozen=True)
class TextReport:
    """What the stream of held-out reviews measured."""

    name: str
    reviews: int
    answered: int  # ok results
    accuracy: float  # served labels against the truth; an unanswered review counts wrong
    offline_accuracy: float  # the model run directly, against the truth
    agreeing: int  # served top-1 label == offline top-1 label
    largest_difference: float  # served top-1 score against the offline one
    texts_per_s: float  # as streamed: answered / (last durable - first produced)
    latency_p50_ms: float
    latency_p99_ms: float

    @property
    def passed(self) -> bool:
        return self.answered == self.reviews and self.reviews - self.agreeing <= LABEL_TOLERANCE


async def run_demo(
    settings: ClientSettings,
    model_name: str,
    *,
    folder: Path,
    held_out: int = HELD_OUT,
    max_steps: int | None = None,
    wait_s: float = 120.0,
) -> TextReport:
    """The review classifier served as ``model_name``, fed ``held_out`` held-out reviews."""
    if not (folder / "tokenizer.json").exists():  # build writes it last
        _say(f"training the review classifier into {folder}")
        started = time.monotonic()
        await asyncio.to_thread(build, folder, max_steps)
        _say(f"trained it in {time.monotonic() - started:.1f} s")
    data = make_reviews(held_out, seed=7)
    positive = data.labels.count("positive")
    _say(f"{held_out} held-out reviews, {positive} of them positive")
    offline = await asyncio.to_thread(predict, folder, data.texts)
    report = await _serve(settings, model_name, folder, data, offline, wait_s)
    _print_summary(report)
    return report


async def _serve(
    settings: ClientSettings,
    name: str,
    folder: Path,
    data: Reviews,
    offline: list[tuple[str, float]],
    wait_s: float,
) -> TextReport:
    await create_model_topics(settings, name, _PARTITIONS)
    log_path = REPO / ".run" / f"demo-worker-{name}.log"
    config = worker_config(settings, name, f"hf:{folder}", "cpu", "--profile", "latency")
    payloads = [text.encode() for text in data.texts]
    async with launch(config, log_path) as worker, AsyncClient(settings) as client:
        _say(f"worker started (pid {worker.pid}); its log: {log_path}")
        started = time.monotonic()
        warmup = await client.submit(payloads[0], model=name, content_type=TEXT)
        await worker.unless_it_dies(client.wait(warmup, wait_s))
        _say(f"worker ready, first answer after {time.monotonic() - started:.1f} s")
        run = uuid.uuid4().hex[:8]
        ids = [f"review-{run}-{n}" for n in range(len(payloads))]
        waiting = asyncio.ensure_future(collect(client, ids, wait_s))
        await worker.unless_it_dies(stream(client, name, payloads, ids, TEXT, RATE))
        _say(f"streamed {len(ids)} reviews at {RATE}/s as text/plain; waiting for their labels")
        results = await worker.unless_it_dies(waiting)
    return _report(name, [results.get(i) for i in ids], data, offline)


def _top(result: Result | None) -> tuple[str, float] | None:
    """The best label of a ``conveyor.text_classification.v1`` result and its score."""
    if result is None or result.status is not Status.ok:
        return None
    best = result.outputs["labels"][0]
    return best["label"], best["score"]


def _report(
    name: str,
    results: Sequence[Result | None],
    data: Reviews,
    offline: list[tuple[str, float]],
) -> TextReport:
    served = [_top(r) for r in results]
    pairs = [(s, o) for s, o in zip(served, offline, strict=True) if s is not None]
    timed = [r for r in results if r is not None and r.timings is not None]
    latencies = sorted(ms for ms in map(latency_ms, timed) if ms is not None)
    spans = [r.timings for r in timed if r.timings is not None]
    first = min((t.produced_ms for t in spans), default=0.0)
    last = max((durable_ms(t) for t in spans), default=0.0)
    labels = [label for label, _ in offline]
    return TextReport(
        name=name,
        reviews=len(results),
        answered=len(pairs),
        accuracy=accuracy([s[0] if s else "" for s in served], data.labels),
        offline_accuracy=accuracy(labels, data.labels),
        agreeing=sum(s[0] == o[0] for s, o in pairs),
        largest_difference=max((abs(s[1] - o[1]) for s, o in pairs), default=float("inf")),
        texts_per_s=len(pairs) / ((last - first) / 1000) if last > first else float("nan"),
        latency_p50_ms=statistics.median(latencies) if latencies else float("nan"),
        latency_p99_ms=percentile(latencies, 99),
    )


def _print_summary(report: TextReport) -> None:
    r = report
    print(
        f"\n{r.name}: {r.answered}/{r.reviews} reviews answered; accuracy {r.accuracy:.1%} "
        f"served, {r.offline_accuracy:.1%} offline\n"
        f"served top-1 labels equal the offline ones for {r.agreeing} of {r.reviews}, "
        f"top-1 scores within {r.largest_difference:.1e}\n"
        f"{r.texts_per_s:.0f} texts/s as streamed, latency p50 {r.latency_p50_ms:.1f} ms, "
        f"p99 {r.latency_p99_ms:.1f} ms (from each request's production to its result's "
        "write to Redis)"
    )
    differing = r.reviews - r.agreeing
    verdict = (
        "OK" if r.passed else f"FAILED: {differing} differ, {r.reviews - r.answered} unanswered"
    )
    print(
        f"\nserved labels equal the model's own (at most {LABEL_TOLERANCE} differing): {verdict}",
        flush=True,
    )


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo.text", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-name", default="reviews-demo", help="prefix of the topic names")
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER, help="the model's folder")
    parser.add_argument("--held-out", type=int, default=HELD_OUT, help="reviews to stream")
    parser.add_argument(
        "--max-steps", type=int, help="training steps when the model is built (default: all)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    parser.add_argument("--kafka-bootstrap", help="[env CONVEYOR_KAFKA_BOOTSTRAP]")
    parser.add_argument("--redis-url", help="[env CONVEYOR_REDIS_URL]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every served label equals the model's own."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.held_out < 1:
        parser.error(f"--held-out {args.held_out}: give at least 1 review to stream")
    settings = client_settings(args.kafka_bootstrap, args.redis_url)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # our errors say it better
    quiet_progress()
    demo = run_demo(
        settings,
        args.model_name,
        folder=args.folder,
        held_out=args.held_out,
        max_steps=args.max_steps,
        wait_s=args.timeout,
    )
    return exit_status(demo, _say)


if __name__ == "__main__":
    sys.exit(main())
