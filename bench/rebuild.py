"""How long ``conveyor results rebuild`` takes to write a reply topic's results back into Redis.

    python -m bench.rebuild [--results 100000] [--partitions 3]
        [--kafka-bootstrap HOST:PORT] [--redis-url URL]

Writes ``--results`` result records (classification results of the digits model's
shape, stored just now) to a fresh reply topic, then times
``producers.rebuild.rebuild_results`` twice against keys Redis does not hold:
the first run writes every result, the second finds them all there and changes
nothing. Prints a table; the topic and the keys are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import redis.asyncio as aioredis
from pydantic import SecretStr

from producers.admin import create_model_topics, delete_model_topics
from producers.rebuild import RebuildReport, rebuild_results
from producers.settings import ClientSettings
from producers.testing import produce
from schemas import (
    OutgoingRecord,
    Timings,
    encode_result,
    ok_result,
    result_headers,
    result_key,
    topics_for,
)

_OUTPUTS = [{"label": str(n), "index": n, "score": 0.9 - n / 10} for n in range(3)]


def _records(model: str, count: int) -> tuple[list[OutgoingRecord], list[str]]:
    now_ms = time.time() * 1000
    timings = Timings(
        produced_ms=int(now_ms) - 20,
        received_ms=now_ms - 15,
        batch_start_ms=now_ms - 10,
        finished_ms=now_ms - 2,
        queue_ms=5,
        inference_ms=8,
        batch_size=32,
        published_ms=now_ms,
    )
    records, ids = [], []
    for n in range(count):
        request_id = f"{model}-{n}"
        result = ok_result(
            request_id, _OUTPUTS, model=model, model_version="1", worker="w0", timings=timings
        )
        records.append(
            OutgoingRecord(request_id.encode(), encode_result(result), result_headers(result))
        )
        ids.append(request_id)
    return records, ids


async def _run(settings: ClientSettings, count: int, partitions: int) -> list[RebuildReport]:
    model = f"rebuild{uuid.uuid4().hex[:8]}"
    redis = aioredis.Redis.from_url(settings.redis_url.get_secret_value())
    await create_model_topics(settings, model, partitions=partitions)
    keys: list[str] = []
    try:
        records, ids = _records(model, count)
        keys = [result_key(i) for i in ids]
        value_bytes = sum(len(r.value) for r in records) / len(records)
        await produce(settings.kafka_bootstrap, topics_for(model).results, records)
        print(f"{count} results of {value_bytes:.0f} bytes on {partitions} partitions")
        print("| run | results read | written | already there | seconds | results/s |")
        print("|---|---|---|---|---|---|")
        reports = []
        for run in ("first (Redis empty)", "second (all there)"):
            started = time.perf_counter()
            report = await rebuild_results(settings, model, 86_400)
            seconds = time.perf_counter() - started
            reports.append(report)
            print(
                f"| {run} | {report.read} | {report.written} | {report.present} "
                f"| {seconds:.2f} | {report.read / seconds:,.0f} |"
            )
        if reports[0].written != count or reports[1].written != 0:
            raise SystemExit(f"expected {count} written, then none: {reports}")
        return reports
    finally:
        for start in range(0, len(keys), 10_000):
            await redis.delete(*keys[start : start + 10_000])
        await redis.aclose()
        await delete_model_topics(settings, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument(
        "--kafka-bootstrap", default=f"127.0.0.1:{os.environ.get('KAFKA_PORT', '9092')}"
    )
    parser.add_argument(
        "--redis-url", default=f"redis://127.0.0.1:{os.environ.get('REDIS_PORT', '6379')}/0"
    )
    args = parser.parse_args()
    settings = ClientSettings(
        kafka_bootstrap=args.kafka_bootstrap, redis_url=SecretStr(args.redis_url)
    )
    asyncio.run(_run(settings, args.results, args.partitions))


if __name__ == "__main__":
    main()
