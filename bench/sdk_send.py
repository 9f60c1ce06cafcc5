"""The SDK's sending rate by image size and Kafka batch size (``send_batch_bytes``), and a
lone ``submit``'s time to the broker's ack by ``send_linger_ms``.

``python -m bench.sdk_send [--sizes 224x224,640x480] [--requests 3000] [--repeats 3]``
sends ``--requests`` synthetic JPEGs of each size with one ``AsyncClient.submit_many``
call, to a fresh 16-partition topic, for each batch size of ``--batch-bytes`` (by
default aiokafka's 16 KB and the SDK's 1 MiB), taking turns within each repeat. Each
variant is a client of its own, warmed up with ten requests first. It prints the
median requests/s of each and writes ``sdk-send-bench.json`` into ``--out``.

``--linger-ms 5,0`` compares lingers instead, taking turns within each repeat: for each,
``--lone`` requests of the first size submitted one after the other (p50 and p99 of each
``submit`` call, which returns on the broker's ack), and ``submit_many``'s rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu import make_corpus
from bench.stats import percentile
from producers.admin import create_model_topics, delete_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings

PARTITIONS = 16


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    model = f"sdksend{uuid.uuid4().hex[:8]}"
    await create_model_topics(base, model, PARTITIONS)
    results: dict[str, Any] = {}
    try:
        if args.linger_ms:
            return await _lingers(base, model, args)
        for size in args.sizes:
            width, height = (int(n) for n in size.split("x"))
            corpus = make_corpus(width, height)
            payloads = corpus.take(args.requests)
            rates: dict[int, list[float]] = {batch: [] for batch in args.batch_bytes}
            for _ in range(args.repeats):
                for batch in args.batch_bytes:
                    settings = base.model_copy(update={"send_batch_bytes": batch})
                    rates[batch].append(await _rate(settings, model, payloads))
            results[size] = {
                "payload_bytes": corpus.mean_kb * 1000,
                "requests_s": {str(b): statistics.median(r) for b, r in rates.items()},
                "runs": {str(b): r for b, r in rates.items()},
            }
            print(f"[bench] {size}: {json.dumps(results[size]['requests_s'])}", flush=True)
    finally:
        await delete_model_topics(base, model)
    return results


async def _rate(settings: ClientSettings, model: str, payloads: Sequence[bytes]) -> float:
    async with AsyncClient(settings) as client:
        await client.submit_many(payloads[:10], model=model)  # connected, topic known
        start = time.perf_counter()
        await client.submit_many(payloads, model=model)
        return len(payloads) / (time.perf_counter() - start)


async def _lingers(base: ClientSettings, model: str, args: argparse.Namespace) -> dict[str, Any]:
    width, height = (int(n) for n in args.sizes[0].split("x"))
    payloads = make_corpus(width, height).take(args.requests)
    lone: dict[int, list[float]] = {linger: [] for linger in args.linger_ms}
    many: dict[int, list[float]] = {linger: [] for linger in args.linger_ms}
    for _ in range(args.repeats):
        for linger in args.linger_ms:
            settings = base.model_copy(update={"send_linger_ms": linger})
            lone[linger] += await _lone_ms(settings, model, payloads[: args.lone])
            many[linger].append(await _rate(settings, model, payloads))
    results = {
        str(linger): {
            "lone_submit_ms_p50": statistics.median(lone[linger]),
            "lone_submit_ms_p99": percentile(lone[linger], 99),
            "submit_many_requests_s": statistics.median(many[linger]),
            "submit_many_runs": many[linger],
        }
        for linger in args.linger_ms
    }
    print(f"[bench] {args.sizes[0]} by linger: {json.dumps(results)}", flush=True)
    return results


async def _lone_ms(settings: ClientSettings, model: str, payloads: Sequence[bytes]) -> list[float]:
    async with AsyncClient(settings) as client:
        await client.submit_many(payloads[:10], model=model)  # connected, topic known
        took = []
        for payload in payloads:
            start = time.perf_counter()
            await client.submit(payload, model=model)
            took.append((time.perf_counter() - start) * 1000.0)
        return took


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=["224x224", "640x480"])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-bytes",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[16 * 1024, 1 << 20],
        help="comma-separated send_batch_bytes to compare",
    )
    parser.add_argument(
        "--linger-ms",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[],
        help="comma-separated send_linger_ms to compare (lone submits and submit_many)",
    )
    parser.add_argument("--lone", type=int, default=200, help="lone submits a linger, a repeat")
    parser.add_argument("--out", type=Path, default=Path(".run/sdk-send-bench"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sdk-send-bench.json").write_text(
        json.dumps(vars(args) | {"results": results}, default=str, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
