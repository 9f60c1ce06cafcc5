"""The fetch path for records of a given size, with and without ``workers.kafka.fetch_buffers``.

``python -m bench.fetch [--payload-bytes 143000] [--records 6000] [--repeats 3]``
writes a backlog of requests of that size to a fresh 8-partition topic, then reads
all of it, repeatedly, three ways taking turns: Kafka's ``kafka-consumer-perf-test``
(unless ``--no-kafka-perf``), and the worker's consumer fetch loop
(``bench.cpu.consumer_fetch_loop``: fetch, track, commit) with ``fetch_buffers``
on and off. Each worker-side reading is a process of its own on the worker's
event loop (uvloop when installed), because the frame reader is installed
process-wide. It prints the medians and writes ``fetch-bench.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cpu import consumer_fetch_loop, default_kafka_libs, kafka_consumer_perf
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import produce, requests
from schemas import ContentType, consumer_group, topics_for
from workers.cli import event_loop_factory
from workers.config.worker import WorkerSettings

PARTITIONS = 8
VARIANTS = {"fetch_buffers": True, "stock": False}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = f"fetchbench{uuid.uuid4().hex[:8]}"
    client = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    await create_model_topics(client, model, PARTITIONS)
    topic = topics_for(model).requests
    try:
        payload = bytes(i % 251 for i in range(args.payload_bytes))
        records, _ = requests([payload], args.records, "f", ContentType.TEXT)
        await produce(args.kafka_bootstrap, topic, records, round_robin=True)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in ("kafka_perf", *VARIANTS)}
        for repeat in range(args.repeats):
            group = f"{consumer_group(model)}.r{repeat}"
            if args.kafka_perf:
                runs["kafka_perf"].append(
                    await kafka_consumer_perf(
                        args.kafka_libs, args.kafka_bootstrap, topic, args.records, group + ".k"
                    )
                )
            for variant in VARIANTS:
                runs[variant].append(await _read_in_a_process(args, topic, group, variant))
            print(f"[bench] repeat {repeat}: {json.dumps(_last(runs))}", flush=True)
    finally:
        await delete_model_topics(client, model)
    median = {
        name: statistics.median(r["records_per_s"] for r in rs) if rs else 0.0
        for name, rs in runs.items()
    }
    cpu = {v: statistics.median(r["cpu_us_per_record"] for r in runs[v]) for v in VARIANTS}
    return {
        "payload_bytes": args.payload_bytes,
        "records": args.records,
        "partitions": PARTITIONS,
        "runs": runs,
        "median_records_per_s": median,
        "median_cpu_us_per_record": cpu,
        "fetch_buffers_vs_stock": _ratio(median["fetch_buffers"], median["stock"]),
        "vs_kafka_perf": {v: _ratio(median[v], median["kafka_perf"]) for v in VARIANTS},
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # None: a reading too small to time (smoke tests)


def _last(runs: dict[str, list[dict[str, float]]]) -> dict[str, int]:
    return {name: round(rs[-1]["records_per_s"]) for name, rs in runs.items() if rs}


async def _read_in_a_process(
    args: argparse.Namespace, topic: str, group: str, variant: str
) -> dict[str, float]:
    command = [
        sys.executable, "-m", "bench.fetch", "--read", f"{topic},{group}.{variant},{variant}",
        "--records", str(args.records), "--kafka-bootstrap", args.kafka_bootstrap,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the {variant} reading failed with status {proc.returncode}")
    result: dict[str, float] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def read(spec: str, args: argparse.Namespace) -> int:
    """``--read TOPIC,GROUP,VARIANT``: one reading of the topic; prints its rates as JSON."""
    topic, group, variant = spec.split(",")
    settings = WorkerSettings(
        model="bench.identity:IdentityHandler",
        model_name="fetchbench",
        kafka_bootstrap=args.kafka_bootstrap,
        fetch_buffers=VARIANTS[variant],
    )
    with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        result = runner.run(consumer_fetch_loop(settings, topic, args.records, group))
    print(json.dumps(result), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--payload-bytes", type=int, default=143_000, help="each record's value")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--kafka-libs", type=Path, default=None, help="Kafka's jars")
    parser.add_argument(
        "--kafka-perf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time kafka-consumer-perf-test (needs Kafka's tools jar)",
    )
    parser.add_argument("--out", type=Path, default=Path(".run/fetch-bench"))
    parser.add_argument("--read", help=argparse.SUPPRESS)  # one worker-side reading
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    if args.read:
        return read(args.read, args)
    args.kafka_libs = args.kafka_libs or default_kafka_libs()
    report = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fetch-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
