"""A lone request on an idle worker, and a backlog, with the idle rule on and off.

``python -m bench.idle [--quick] [--repeats 3] [--requests 100] [--out FILE]`` serves the
demo digits CNN (8x8 PNGs) with the defaults (``--max-delay-ms 5``), once with
``--close-idle-batches`` (the default: a batch closes at once when the consumer caught
up) and once with ``--no-close-idle-batches`` (the batch waits for ``max_delay``), taking
turns in each repeat on the same broker and Redis:

- lone: ``--requests`` requests sent one after the other to a ready, idle worker, each
  after the previous one's result is in Redis; from each result's own timings, the
  record's timestamp to its publish (``published_ms - produced_ms``) and its wait in the
  worker (``queue_ms``);
- backlog: ``bench.cpu`` scenario 4's micro-batched run (6,000 requests queued before
  the worker starts, first fetch to every result in Redis), requests/s.

Prints one line per run and a table last (medians over the repeats), and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cpu import FULL, QUICK, Bench, _digit_requests, _machine, default_kafka_libs
from bench.services import Services
from bench.stats import percentile
from demo.models.digits import build_digits_model, heldout_digits
from producers.testing import produce, read_results, until_all_ready, wait_for_results

VARIANTS = {"idle_rule_on": ["--close-idle-batches"], "idle_rule_off": ["--no-close-idle-batches"]}


async def lone(
    bench: Bench, digits: Sequence[tuple[bytes, int]], name: str, options: list[str], count: int
) -> dict[str, Any]:
    """``count`` requests one at a time on a ready worker of ``options``."""
    async with bench.fresh_model(f"lone-{name.replace('_', '-')}") as (model, topics, ids):
        config = bench.worker("digits", model, options)
        async with bench.launch(config, bench.log_dir / f"{model}.log") as worker:
            await until_all_ready([worker], timeout_s=120, settle_s=1.0)
            records, ids[:] = _digit_requests(model, digits, count, tag="lone")
            for record, request_id in zip(records, ids, strict=True):
                await produce(bench.services.kafka_bootstrap, topics.requests, [record])
                await worker.unless_it_dies(
                    wait_for_results(bench.services.redis_url, [request_id], timeout_s=30)
                )
        results = (await read_results(bench.services.redis_url, ids)).values()
    timings = [r.timings for r in results if r.timings is not None]
    to_publish = [t.published_ms - t.produced_ms for t in timings if t.published_ms is not None]
    queue = [t.queue_ms for t in timings]
    return {
        "requests": len(timings),
        "record_to_publish_ms": _spread(to_publish),
        "queue_ms": _spread(queue),
        "mean_batch": statistics.fmean(t.batch_size for t in timings),
    }


async def backlog(
    bench: Bench, digits: Sequence[tuple[bytes, int]], name: str, options: list[str]
) -> dict[str, Any]:
    async with bench.fresh_model(f"backlog-{name.replace('_', '-')}") as (model, _topics, ids):
        records, ids[:] = _digit_requests(model, digits, bench.plan.batching_requests)
        config = bench.worker("digits", model, options)
        return await bench.serve_backlog(config, records, ids, label=name)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


async def run(bench: Bench, repeats: int, count: int) -> dict[str, Any]:
    await asyncio.to_thread(build_digits_model)
    digits = heldout_digits()
    meta = _machine() | {"load_average_before": os.getloadavg(), "date": time.strftime("%F %T")}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
        for name in order:  # taking turns, the first of each repeat alternating
            one: dict[str, Any] = {"lone": await lone(bench, digits, name, VARIANTS[name], count)}
            one["backlog"] = await backlog(bench, digits, name, VARIANTS[name])
            one["load_average"] = os.getloadavg()
            runs[name].append(one)
            print(f"[idle] {repeat} {name}: {json.dumps(one)}", flush=True)
    meta["load_average_after"] = os.getloadavg()
    return {"meta": meta, "runs": runs, "summary": summary(runs)}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per variant, the medians over the repeats."""
    out = {}
    for name, repeats in runs.items():
        out[name] = {
            "lone_p50_ms": statistics.median(
                r["lone"]["record_to_publish_ms"]["p50"] for r in repeats
            ),
            "lone_p99_ms": statistics.median(
                r["lone"]["record_to_publish_ms"]["p99"] for r in repeats
            ),
            "lone_queue_p50_ms": statistics.median(r["lone"]["queue_ms"]["p50"] for r in repeats),
            "backlog_rate": statistics.median(float(r["backlog"]["rate"]) for r in repeats),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.idle", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks the script runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100, help="lone requests a run")
    parser.add_argument("--out", type=Path, default=Path("idle-bench.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/conveyor-bench-idle"))
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(
        services=Services(args.kafka_bootstrap, args.redis_url),
        plan=QUICK if args.quick else FULL,
        log_dir=args.log_dir,
        kafka_libs=default_kafka_libs(),
        run_id=uuid.uuid4().hex[:8],
        quick=args.quick,
    )
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    count = 5 if args.quick else args.requests
    report = asyncio.run(run(bench, 1 if args.quick else args.repeats, count))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("variant | lone p50 ms | lone p99 ms | lone wait in worker p50 ms | backlog req/s")
    for name, row in report["summary"].items():
        print(f"{name} | {row['lone_p50_ms']:.2f} | {row['lone_p99_ms']:.2f} | "
              f"{row['lone_queue_p50_ms']:.2f} | {row['backlog_rate']:,.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
