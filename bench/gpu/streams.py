"""Camera streams through a host: ``--chain-streams`` streams at ``--chain-fps`` frames a
second each, paced open loop, and each stream's frame latency against a bound written
down before the run (``--stream-p99-bound-ms``).

Frame ``n`` of stream ``k`` is request ``<prefix>-<n * streams + k>``, with ``ce_stream``
``<prefix>-s<k>`` (so its key: a stream's frames share a partition, in order) and
``ce_seq`` ``n``. Producer processes split the streams between them (``paced_processes``
says how many a load's bytes and records a second need), so every frame of a stream is
sent by one process, in order, stamped with the time it was due
(``producers.testing.produce_at_rate``: a producer that falls behind shows as latency).

A frame's latency is from that due time to its result's publication (``published_ms``,
after a pipeline's last child; ``finished_ms`` where a model publishes no such time).
Per stream: p50 and p99 (nearest rank), and how many of its results were published
after a later frame's (a pipeline's parent waits for its slowest child); then the worst
stream by p99. The default bound, 100 ms, is three frame intervals at 30 frames a
second: a live view or a tracker that falls more than that behind the camera acts on a
scene that has moved on. It is written down here, not fitted to a run's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from bench.gpu.cores import _pin_all_threads, _producer_cores
from bench.gpu.corpus import Corpus, make_corpus
from bench.gpu.load import _all_say, _tell_all, paced_processes, shares_of
from bench.stats import acked_summary, percentile
from producers.testing import produce_at_rate
from schemas import ContentType, OutgoingRecord, Result, encode_request, topics_for

STREAM_P99_BOUND_MS = 100.0
"""The default bound on every stream's p99 frame latency: see the module doc."""


def stream_records(
    corpus: Corpus, prefix: str, streams: int, frames: int, mine: Sequence[int]
) -> list[OutgoingRecord]:
    """The frames of streams ``mine`` (of ``streams``), frame 0 of each, then frame 1...:
    each stream's frames in order, at one frame interval apart once paced."""
    images = corpus.payloads
    return [
        encode_request(
            images[(n * streams + k) % len(images)],
            request_id=f"{prefix}-{n * streams + k}",
            content_type=ContentType.JPEG,
            source="bench.gpu",
            stream=f"{prefix}-s{k}",
            seq=n,
        )
        for n in range(frames)
        for k in mine
    ]


def produce_streams_share(spec: str, args: argparse.Namespace) -> int:
    """``--produce-streams TOPIC,W,H,PREFIX,STREAMS,FRAMES,FPS,K1:K2:...``: one process's
    streams of a paced load; prints "ready", sends when a line comes in, then prints
    (JSON) the rate it achieved and its acknowledgements after due time."""
    topic, width, height, prefix, streams, frames, fps, mine = spec.split(",")
    own = [int(k) for k in mine.split(":")]
    corpus = make_corpus(int(width), int(height))
    records = stream_records(corpus, prefix, int(streams), int(frames), own)
    print("ready", flush=True)
    sys.stdin.readline()
    acked: list[float] = []
    rate = float(fps) * len(own)
    achieved = asyncio.run(produce_at_rate(args.kafka_bootstrap, topic, records, rate, acked))
    print(json.dumps({"rate": achieved} | acked_summary(acked)), flush=True)
    return 0


async def paced_streams(
    args: argparse.Namespace, model: str, corpus: Corpus, prefix: str, frames: int
) -> dict[str, float]:
    """``--chain-streams`` streams of ``frames`` frames each to ``model``, paced at
    ``--chain-fps``, from as many producer processes as the load needs (each with whole
    streams); the rate achieved together and the worst process's acknowledgements."""
    streams = args.chain_streams
    mean_bytes = statistics.fmean(len(image) for image in corpus.payloads)
    processes = min(streams, paced_processes(streams * args.chain_fps, mean_bytes))
    procs = []
    for p in range(processes):
        mine = ":".join(str(k) for k in range(p, streams, processes))
        spec = f"{topics_for(model).requests},{corpus.width},{corpus.height},{prefix}"
        spec += f",{streams},{frames},{args.chain_fps},{mine}"
        command = [
            sys.executable, "-m", "bench.gpu.load", "--produce-streams", spec,
            "--kafka-bootstrap", args.kafka_bootstrap,
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        procs.append(proc)
        if args.pin:
            _pin_all_threads(proc.pid, _producer_cores(args))
    await _all_say(procs, b"ready")
    await _tell_all(procs, b"go")
    shares = await shares_of(procs, "a stream producer")
    return {
        "processes": processes,
        "offered_fps": streams * args.chain_fps,
        "sent_fps": round(sum(share["rate"] for share in shares), 1),
        "acked_p99_ms": max(share["acked_p99_ms"] for share in shares),
    }


def per_stream(
    results: Sequence[Result], prefix: str, streams: int, bound_ms: float
) -> dict[str, Any]:
    """Each stream's frame latency (p50, p99) and order, the worst stream, and whether
    every stream's p99 is within ``bound_ms`` (see the module doc)."""
    by_stream: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for result in results:
        n = int(result.id.removeprefix(f"{prefix}-"))
        timings = result.timings
        if timings is None:  # only answers without a request to time have none
            continue
        published = timings.published_ms
        if published is None:
            published = timings.finished_ms
        by_stream[n % streams].append((n // streams, published, published - timings.produced_ms))
    rows: dict[str, dict[str, float]] = {}
    for k, frames in sorted(by_stream.items()):
        latencies = [latency for _, _, latency in frames]
        rows[f"s{k}"] = {
            "frames": len(frames),
            "p50_ms": round(percentile(latencies, 50), 1),
            "p99_ms": round(percentile(latencies, 99), 1),
            "out_of_order": _out_of_order(frames),
        }
    worst = max(rows, key=lambda k: rows[k]["p99_ms"]) if rows else None
    every = [latency for frames in by_stream.values() for _, _, latency in frames]
    return {
        "streams": len(rows),
        "frames": len(every),
        "p50_ms": round(percentile(every, 50), 1),
        "p99_ms": round(percentile(every, 99), 1),
        "worst_stream": worst,
        "worst_p99_ms": rows[worst]["p99_ms"] if worst is not None else None,
        "bound_ms": bound_ms,
        "streams_over_bound": sum(row["p99_ms"] > bound_ms for row in rows.values()),
        "within_bound": bool(rows) and all(row["p99_ms"] <= bound_ms for row in rows.values()),
        "out_of_order": sum(int(row["out_of_order"]) for row in rows.values()),
        "per_stream": rows,
    }


def _out_of_order(frames: Sequence[tuple[int, float, float]]) -> int:
    """Frames published after a later frame of their stream (by sequence number)."""
    latest = -1
    late = 0
    for seq, _, _ in sorted(frames, key=lambda frame: (frame[1], frame[0])):
        if seq < latest:
            late += 1
        latest = max(latest, seq)
    return late
