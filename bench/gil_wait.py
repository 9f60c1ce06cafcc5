"""Append to fetch on the worker's event loop beside threads running Python, per switch interval.

``python -m bench.gil_wait [--rate 300] [--payload-bytes 145000] [--seconds 8]
[--intervals-ms 5,1,0.5,0.2] [--busy-threads 2] [--repeats 3]`` writes records at a
steady rate to a fresh one-partition topic that stamps ``LogAppendTime``, while a
reader process takes them with the worker's consumer (``workers.kafka.consumer``, fetch
buffers on, the worker's event loop) and times each from its append in Kafka to its
fetch. Beside the reader's event loop run ``--busy-threads`` threads that each run
Python for ``--busy-ms`` then sleep ``--idle-ms``, as a worker's decode, prepare and
finish threads do between their calls into torch. Each variant sets the switch
interval the way the worker does (``workers.app.switch_interval``); a variant with no
busy threads is the floor. Variants take turns, each row the median of ``--repeats``.
It prints the table and writes ``gil-wait.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.stats import percentile
from producers.testing import produce_at_rate, requests
from schemas import ContentType
from workers.app import start_up_objects_frozen, switch_interval
from workers.cli import event_loop_factory
from workers.config.worker import WorkerSettings
from workers.kafka.consumer import Consumer

_WARM_UP_MS = 1000  # records appended in the first second are read, not counted
_MEASURES = ("p50_ms", "p90_ms", "p99_ms", "busy_runs_per_s")


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant once per repeat, taking turns; each row the medians of its repeats."""
    variants = [(0, 5.0)] + [(args.busy_threads, ms) for ms in args.intervals_ms]
    runs: dict[tuple[int, float], list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for busy, ms in variants:
            runs[busy, ms].append(await _one(args, busy, ms))
            print(
                json.dumps(
                    {"repeat": repeat, "busy_threads": busy, "interval_ms": ms} | runs[busy, ms][-1]
                ),
                flush=True,
            )
    return [
        {"busy_threads": busy, "interval_ms": ms, "runs": rs}
        | {key: statistics.median(r[key] for r in rs) for key in _MEASURES}
        for (busy, ms), rs in runs.items()
    ]


async def _one(args: argparse.Namespace, busy: int, ms: float) -> dict[str, Any]:
    """A fresh topic, a reader process with ``busy`` threads and switch interval ``ms``."""
    topic = f"gilwait-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=args.kafka_bootstrap)
    await admin.start()
    try:
        config = {"message.timestamp.type": "LogAppendTime"}
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=config)])
        reader = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "bench.gil_wait", "--read", f"{topic},{busy},{ms}"),
            *("--kafka-bootstrap", args.kafka_bootstrap),
            *("--busy-ms", str(args.busy_ms), "--idle-ms", str(args.idle_ms)),
            *("--rate", str(args.rate), "--seconds", str(args.seconds)),
            stdout=asyncio.subprocess.PIPE,
        )
        assert reader.stdout is not None
        ready = await reader.stdout.readline()  # in the group, the partition held
        if ready.strip() != b"ready":
            raise RuntimeError(f"the reader stopped before it was ready: {ready!r}")
        payload = bytes(i % 251 for i in range(args.payload_bytes))
        records, _ = requests([payload], _count(args), "g", ContentType.TEXT, "bench.gil_wait")
        await produce_at_rate(args.kafka_bootstrap, topic, records, args.rate)
        out, _ = await reader.communicate()
        if reader.returncode != 0:
            raise RuntimeError(f"the reader failed with status {reader.returncode}")
        measured: dict[str, Any] = json.loads(out)
        return {"written": len(records)} | measured
    finally:
        await admin.delete_topics([topic])
        await admin.close()


def read(spec: str, args: argparse.Namespace) -> int:
    """``--read TOPIC,BUSY,MS``: one reader; prints the append-to-fetch times as JSON."""
    topic, busy, ms = spec.split(",")
    settings = WorkerSettings(
        model="bench.identity:IdentityHandler",
        model_name="gilwait",
        kafka_bootstrap=args.kafka_bootstrap,
        switch_interval_ms=float(ms),
    )
    stop, work = threading.Event(), [0] * int(busy)
    for index in range(int(busy)):
        threading.Thread(target=_busy, args=(args, stop, work, index), daemon=True).start()
    with (
        switch_interval(settings.switch_interval_ms),
        start_up_objects_frozen(),  # as in the worker: no full collection walks torch's objects
        asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner,
    ):
        started = time.monotonic()
        waits = runner.run(_fetch(settings, topic, _count(args)))
        elapsed = time.monotonic() - started
    stop.set()
    report = {q: percentile(waits, p) for q, p in (("p50_ms", 50), ("p90_ms", 90), ("p99_ms", 99))}
    report |= {"records": len(waits), "busy_runs_per_s": sum(work) / elapsed}
    print(json.dumps(report), flush=True)
    return 0


def _busy(args: argparse.Namespace, stop: threading.Event, work: list[int], index: int) -> None:
    """Python for ``--busy-ms``, then a sleep of ``--idle-ms``, until ``stop``."""
    while not stop.is_set():
        until = time.perf_counter() + args.busy_ms / 1000.0
        while time.perf_counter() < until:
            pass
        work[index] += 1
        time.sleep(args.idle_ms / 1000.0)


def _count(args: argparse.Namespace) -> int:
    return int(args.rate * args.seconds)


async def _fetch(settings: WorkerSettings, topic: str, count: int) -> list[float]:
    """Milliseconds from append to fetch of each of ``count`` records (after the warm-up)."""
    waits: list[float] = []
    async with Consumer(settings, topic, f"{topic}.reader") as consumer:
        while not consumer.assigned():
            await consumer.fetch(100, 1)
        print("ready", flush=True)
        fetched, counted_from = 0, None
        while fetched < count:
            chunks = await consumer.fetch(100, settings.max_batch_size * 4)
            now_ms = time.time() * 1000.0
            for records in chunks.values():
                fetched += len(records)
                if counted_from is None:
                    counted_from = records[0].timestamp + _WARM_UP_MS
                waits += [now_ms - r.timestamp for r in records if r.timestamp >= counted_from]
    return waits


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gil_wait", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rate", type=float, default=300.0, help="records a second")
    parser.add_argument("--payload-bytes", type=int, default=145_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--intervals-ms",
        type=lambda text: [float(ms) for ms in text.split(",")],
        default=[5.0, 1.0, 0.5, 0.2],
        help="switch intervals, comma-separated",
    )
    parser.add_argument("--busy-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="each variant, taking turns")
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--idle-ms", type=float, default=2.0)
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--out", type=Path, default=Path(".run/gil-wait"))
    parser.add_argument("--read", help=argparse.SUPPRESS)  # one reader process
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.read:
        return read(args.read, args)
    rows = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gil-wait.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("busy threads | switch ms | append->fetch p50 / p90 / p99 ms | busy runs/s")
    for row in rows:
        print(
            f"{row['busy_threads']:>12} | {row['interval_ms']:>9} | {row['p50_ms']:.1f} / "
            f"{row['p90_ms']:.1f} / {row['p99_ms']:.1f} | {row['busy_runs_per_s']:.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
