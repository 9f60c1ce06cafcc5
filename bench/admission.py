"""What ``--cancellation`` and ``--track-status`` cost: the identity model from a backlog.

``python -m bench.admission [--requests N] [--repeats R]`` serves the same kind of
backlog as ``bench.cpu``'s overhead scenario (16-byte payloads, batches of 256)
with the features off, with ``--cancellation``, and with both, interleaved run
by run so that a busy machine slows every variant alike; it prints the median
rate of each and its ratio to the plain worker. With either feature on, a
worker makes one Redis script call per batch before the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench.cpu import (
    FULL,
    IDENTITY,
    OVERHEAD_BATCH,
    REPO,
    SMALL_PAYLOAD,
    Bench,
    _requests,
    default_kafka_libs,
)
from bench.services import Services
from schemas import ContentType

VARIANTS: dict[str, tuple[str, ...]] = {
    "off": (),
    "cancellation": ("--cancellation",),
    "cancellation+status": ("--cancellation", "--track-status"),
}


async def compare(bench: Bench, requests: int, repeats: int) -> dict[str, object]:
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    async with bench.fresh_model("admission") as (model, _topics, ids):
        for repeat in range(repeats):
            for name, flags in VARIANTS.items():
                options = ["--max-batch-size", str(OVERHEAD_BATCH), *flags]
                config = bench.worker(IDENTITY, model, options)
                prefix = f"{name.replace('+', '-')}{repeat}"
                records, batch_ids = _requests(
                    model, SMALL_PAYLOAD, ContentType.TEXT, requests, prefix
                )
                ids += batch_ids
                run = await bench.serve_backlog(config, records, batch_ids)
                rates[name].append(float(run["rate"]))
                print(f"{name:<20} run {repeat}: {run['rate']:.0f} requests/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "requests_per_run": requests,
        "rates": rates,
        "median": medians,
        "ratio_to_off": {name: medians[name] / medians["off"] for name in VARIANTS},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=50_000, help="per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".run" / "bench")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(
        services=Services(args.kafka_bootstrap, args.redis_url),
        plan=FULL,
        log_dir=args.log_dir,
        kafka_libs=default_kafka_libs(),
        run_id=uuid.uuid4().hex[:8],
        quick=False,
    )
    report = asyncio.run(compare(bench, args.requests, args.repeats))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
