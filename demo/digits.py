"""The end-to-end demo: serve the bundled digits model and score it through Kafka.

``python -m demo.digits`` (what ``make demo`` runs after ``make up``):

1. builds the digits model unless it is cached, and reads its offline held-out accuracy;
2. creates the demo model's topics;
3. starts ``conveyor worker --model digits`` as a child process;
4. submits every held-out digit with the client SDK and waits for all results;
5. prints a few rows and a summary: accuracy, requests/s, p50/p99 latency;
6. stops the worker (SIGTERM, then waits for it to drain), also on Ctrl-C or error.

It exits with status 1 when the served accuracy is more than one point below the
offline accuracy: the serving path then changes what the model computes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from demo.models.digits import build_digits_model, digits_metadata, heldout_digits
from demo.worker import (
    REPO,
    client_settings,
    durable_ms,
    exit_status,
    latency_ms,
    launch,
    percentile,
    worker_config,
)
from producers import AsyncClient, ClientSettings, Result, Status
from producers.admin import create_model_topics

ACCURACY_TOLERANCE = 0.01
"""How far (as a fraction) served accuracy may fall below the offline accuracy."""
_PARTITIONS = 2
_TABLE_ROWS = 15


@dataclass(frozen=True)
class DemoReport:
    """What a demo run measured."""

    answered: int  # results received (all of them, or the demo fails)
    correct: int  # ok results whose top-1 label is the true digit
    offline_accuracy: float  # the model's held-out accuracy measured at build time
    requests_per_s: float  # answered / (last published - first produced)
    latency_p50_ms: float  # produced -> sent to Redis, from each result's timings
    latency_p99_ms: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.answered if self.answered else 0.0

    @property
    def passed(self) -> bool:
        return self.accuracy >= self.offline_accuracy - ACCURACY_TOLERANCE - 1e-9


async def run_demo(
    settings: ClientSettings,
    model_name: str,
    *,
    device: str = "auto",
    wait_s: float = 120.0,
    log_path: Path | None = None,
) -> DemoReport:
    """Serve the digits model as ``model_name`` and score it on the held-out digits.

    ``wait_s`` bounds the wait for the worker's first answer and then for all the others.
    """
    offline = await asyncio.to_thread(_offline_accuracy)
    digits = await asyncio.to_thread(heldout_digits)
    states = await create_model_topics(settings, model_name, _PARTITIONS)
    _say(f"topics {', '.join(state.name for state in states)} ready")
    log_path = log_path or REPO / ".run" / f"demo-worker-{model_name}.log"
    config = worker_config(settings, model_name, "digits", device)
    async with launch(config, log_path) as worker, AsyncClient(settings) as client:
        _say(f"worker started (pid {worker.pid}); its log: {log_path}")
        # The first answer says the worker has loaded the model and joined its group.
        started = time.monotonic()
        warmup = await client.submit(digits[0][0], model=model_name)
        await worker.unless_it_dies(client.wait(warmup, wait_s))
        _say(f"worker ready: first answer after {time.monotonic() - started:.1f} s")

        run = uuid.uuid4().hex[:8]
        truth = {f"demo-{run}-{n}": digit for n, (_png, digit) in enumerate(digits)}
        await client.submit_many(
            [png for png, _digit in digits], model=model_name, request_ids=list(truth)
        )
        _say(f"submitted {len(truth)} held-out digits; waiting for their results")
        results = await worker.unless_it_dies(_collect(client, list(truth), wait_s))
    _say("worker stopped")
    report = _report(results, truth, offline)
    _print_table(results[:_TABLE_ROWS], truth)
    _print_summary(report)
    return report


async def _collect(client: AsyncClient, ids: list[str], wait_s: float) -> list[Result]:
    """Every result, in completion order."""
    return [result async for result in client.wait_many(ids, wait_s)]


def _offline_accuracy() -> float:
    build_digits_model()
    metadata = digits_metadata()
    accuracy = float(metadata["heldout_accuracy"])
    _say(
        f"model {metadata['version']}: offline held-out accuracy {accuracy:.2%} "
        f"on {metadata['heldout_size']} digits"
    )
    return accuracy


def _top1(result: Result) -> tuple[int, float] | None:
    if result.status is not Status.ok or not result.outputs:
        return None
    best = result.outputs[0]
    return int(best["index"]), float(best["score"])


def _report(results: list[Result], truth: dict[str, int], offline: float) -> DemoReport:
    correct = 0
    for result in results:
        top1 = _top1(result)
        correct += top1 is not None and top1[0] == truth[result.id]
    latencies = sorted(ms for ms in map(latency_ms, results) if ms is not None)
    spans = [r.timings for r in results if r.timings is not None]
    elapsed_s = (
        (max(durable_ms(t) for t in spans) - min(t.produced_ms for t in spans)) / 1000
        if spans
        else math.nan
    )
    return DemoReport(
        answered=len(results),
        correct=correct,
        offline_accuracy=offline,
        requests_per_s=len(results) / elapsed_s if elapsed_s > 0 else math.nan,
        latency_p50_ms=statistics.median(latencies) if latencies else math.nan,
        latency_p99_ms=percentile(latencies, 99),
    )


def _print_table(results: Sequence[Result], truth: dict[str, int]) -> None:
    print(f"\n{'request id':<24} {'true':>4} {'predicted':>9} {'score':>6} {'latency ms':>10}")
    for result in results:
        top1 = _top1(result)
        predicted, score = (str(top1[0]), f"{top1[1]:.3f}") if top1 else (result.status, "-")
        latency = latency_ms(result)
        shown = "-" if latency is None else f"{latency:.1f}"
        print(f"{result.id:<24} {truth[result.id]:>4} {predicted:>9} {score:>6} {shown:>10}")


def _print_summary(report: DemoReport) -> None:
    verdict = "OK" if report.passed else "FAILED: more than 1 point below offline"
    print(
        f"\naccuracy {report.accuracy:.2%} ({report.correct}/{report.answered}), "
        f"offline {report.offline_accuracy:.2%}: {verdict}\n"
        f"throughput {report.requests_per_s:.0f} requests/s, "
        f"latency p50 {report.latency_p50_ms:.1f} ms, p99 {report.latency_p99_ms:.1f} ms "
        "(from each result's produced and published times: to durability in Redis)",
        flush=True,
    )


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo.digits", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-name", default="digits-demo", help="name in the topic names")
    parser.add_argument("--device", default="auto", help="the worker's device: auto, cpu, cuda")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    parser.add_argument(
        "--worker-log", type=Path, help="the worker's log file (default .run/demo-worker-NAME.log)"
    )
    parser.add_argument("--kafka-bootstrap", help="[env CONVEYOR_KAFKA_BOOTSTRAP]")
    parser.add_argument("--redis-url", help="[env CONVEYOR_REDIS_URL]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when served accuracy is within one point of the offline accuracy."""
    args = _parser().parse_args(argv)
    settings = client_settings(args.kafka_bootstrap, args.redis_url)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # our errors say it better
    demo = run_demo(
        settings, args.model_name, device=args.device, wait_s=args.timeout, log_path=args.worker_log
    )
    return exit_status(demo, _say)


if __name__ == "__main__":
    sys.exit(main())
