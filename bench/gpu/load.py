"""The end-to-end stages' load, sent from producer processes of their own.

One Python producer cannot keep a GPU fed with 150 KB images, so the load comes from
``python -m bench.gpu.load --produce`` / ``--produce-paced`` processes: backlogs written in
Kafka transactions committed together, and paced loads sent open loop from as many
processes as their bytes and records a second need. Both sides are here: the one that
starts and steps the processes, and each process's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.gpu.cores import _pin_all_threads, _producer_cores
from bench.gpu.corpus import Corpus, _records, corpus_named
from bench.stats import (
    acked_summary,
)
from producers.testing import (
    produce,
    produce_at_rate,
)
from schemas import topics_for


async def _produce_parallel(
    args: argparse.Namespace,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    partitions: int,
    on_visible: Callable[[], None] | None = None,
) -> float:
    """The backlog from ``--producers`` processes at once (one Python producer cannot keep
    a GPU worker fed with 150 KB images); returns the records/s they achieved together.

    Each process builds its records first and says so; all start sending together, so
    the rate counts sending only. Each writes its share in a Kafka transaction and
    commits when told, once every process has written all of its share: the workers
    (which read ``read_committed``) see the whole backlog at once, so what is timed
    is their rate, not the producers'.
    """
    return await produce_at_once(args, corpus, [(model, prefix, count)], partitions, on_visible)


async def produce_at_once(
    args: argparse.Namespace,
    corpus: Corpus,
    backlogs: Sequence[tuple[str, str, int]],
    partitions: int,
    on_visible: Callable[[], None] | None = None,
) -> float:
    """Backlogs (model, request id prefix, count) of several models written as
    ``_produce_parallel`` writes one, ``--producers`` processes each, and made visible
    at the same moment; the records/s of the writing, all backlogs together."""
    procs = []
    for model, prefix, count in backlogs:
        procs += await _producers(
            args, "--produce", model, corpus, prefix, count, partitions, args.producers
        )
    await _all_say(procs, b"ready")  # each once its records are built
    started = time.perf_counter()
    await _tell_all(procs, b"go")
    await _all_say(procs, b"sent")  # each once its share is written, not yet committed
    seconds = time.perf_counter() - started
    rate = sum(count for _, _, count in backlogs) / seconds if seconds > 0 else math.nan
    if on_visible is not None:  # the workers are about to see the backlog
        on_visible()
    await _tell_all(procs, b"commit")
    codes = [await proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"a producer failed: exit statuses {codes}")
    return rate


# What one Python producer sends open loop with room to spare, in bytes and in records a
# second: on an H100 host one fell behind at 1,000 records of 143 KB and at 3,400 of 25 KB.
_PACED_BYTES_PER_S = 100e6
_PACED_RECORDS_PER_S = 1500.0


async def _paced_parallel(
    args: argparse.Namespace,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    rate: float,
    partitions: int,
    on_go: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """``count`` requests open loop at ``rate`` in all, from as many producer processes as
    the corpus's bytes and records per second need; each stamps a record with the time it
    was due. Returns the rate achieved together (the slowest process's share times their
    number) and the worst process's acknowledgement after due time (``produce_at_rate``),
    p50 and p99. ``on_go`` runs as the producers are told to start."""
    mean_bytes = statistics.fmean(len(image) for image in corpus.payloads)
    processes = min(count, paced_processes(rate, mean_bytes))
    procs = await _producers(
        args,
        "--produce-paced",
        model,
        corpus,
        prefix,
        count,
        partitions,
        processes,
        f",{rate / processes}",
    )
    await _all_say(procs, b"ready")
    on_go()
    await _tell_all(procs, b"go")
    shares = await shares_of(procs, "a paced producer")
    return {
        "rate": min(share["rate"] for share in shares) * processes,
        # The worst process's: percentiles of separate processes do not merge.
        "acked_p50_ms": max(share["acked_p50_ms"] for share in shares),
        "acked_p99_ms": max(share["acked_p99_ms"] for share in shares),
    }


def paced_processes(rate: float, mean_bytes: float) -> int:
    """Producer processes a paced load of ``rate`` records of ``mean_bytes`` a second needs."""
    return max(
        1,
        math.ceil(rate * mean_bytes / _PACED_BYTES_PER_S),
        math.ceil(rate / _PACED_RECORDS_PER_S),
    )


def produce_paced_share(spec: str, args: argparse.Namespace) -> int:
    """``--produce-paced TOPIC,CORPUS,PREFIX,FIRST,COUNT,RATE``: one process's share of a paced
    load; prints "ready", sends when a line comes in, then prints (JSON) the rate it
    achieved and its records' acknowledgement after their due time (p50, p99)."""
    topic, name, prefix, first, count, rate = spec.split(",")
    corpus = corpus_named(name)
    ids = [f"{prefix}-{n}" for n in range(int(first), int(first) + int(count))]
    records = _records(corpus, ids, args.request_params)
    print("ready", flush=True)
    sys.stdin.readline()
    acked: list[float] = []
    achieved = asyncio.run(
        produce_at_rate(args.kafka_bootstrap, topic, records, float(rate), acked)
    )
    print(json.dumps({"rate": achieved} | acked_summary(acked)), flush=True)
    return 0


async def _producers(
    args: argparse.Namespace,
    mode: str,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    partitions: int,
    processes: int,
    more: str = "",
) -> list[asyncio.subprocess.Process]:
    """``processes`` producer processes (``python -m bench.gpu.load MODE SPEC``), each with
    its share of requests ``<prefix>-0`` to ``<prefix>-<count - 1>``, pinned with ``--pin``."""
    share = [count // processes + (k < count % processes) for k in range(processes)]
    first, procs = 0, []
    for n in share:
        spec = f"{topics_for(model).requests},{corpus.name},{prefix},{first},{n}"
        command = [
            sys.executable, "-m", "bench.gpu.load", mode, spec + more,
            "--kafka-bootstrap", args.kafka_bootstrap,
            "--request-params", json.dumps(args.request_params),
        ]  # fmt: skip
        first += n
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        procs.append(proc)
        if args.pin:
            _pin_all_threads(proc.pid, _producer_cores(args))
    return procs


async def _all_say(procs: Sequence[asyncio.subprocess.Process], word: bytes) -> None:
    for proc in procs:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if line.strip() != word:
            raise RuntimeError(f"a producer did not say {word!r}: {line!r}")


async def shares_of(procs: Sequence[asyncio.subprocess.Process], what: str) -> list[dict[str, Any]]:
    """Each process's last line (JSON: what its share measured), once all have exited 0."""
    shares = []
    for proc in procs:
        assert proc.stdout is not None
        shares.append(json.loads(await proc.stdout.readline()))
    codes = [await proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"{what} failed: exit statuses {codes}")
    return shares


async def _tell_all(procs: Sequence[asyncio.subprocess.Process], word: bytes) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(word + b"\n")
        await proc.stdin.drain()


def produce_share(spec: str, args: argparse.Namespace) -> int:
    """``--produce TOPIC,CORPUS,PREFIX,FIRST,COUNT``: one producer process's share of a
    backlog (the corpus is rebuilt from its name, ``corpus_named``, so every process sends
    the same payloads).
    Prints "ready" once its records are built and sends them in a transaction when a line
    comes in; prints "sent" when all are written, and commits when the next line comes."""
    topic, name, prefix, first, count = spec.split(",")
    corpus = corpus_named(name)
    ids = [f"{prefix}-{n}" for n in range(int(first), int(first) + int(count))]
    records = _records(corpus, ids, args.request_params)
    print("ready", flush=True)
    sys.stdin.readline()

    async def sent() -> None:
        print("sent", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    transaction = f"gpubench-{prefix}-{first}"
    asyncio.run(
        produce(
            args.kafka_bootstrap,
            topic,
            records,
            round_robin=True,
            transactional_id=transaction,
            before_commit=sent,
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """One producer process of the load (``_producers`` starts them): ``--produce SPEC``
    (``produce_share``), ``--produce-paced SPEC`` (``produce_paced_share``) or
    ``--produce-streams SPEC`` (``bench.gpu.streams.produce_streams_share``). Torch and
    the stages stay unimported, so a load of several processes starts in a second."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.load")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--produce", help="TOPIC,CORPUS,PREFIX,FIRST,COUNT: a backlog's share")
    mode.add_argument("--produce-paced", help="the same, then ,RATE: a paced load's share")
    mode.add_argument(
        "--produce-streams", help="TOPIC,W,H,PREFIX,STREAMS,FRAMES,FPS,K1:K2:...: streams' share"
    )
    parser.add_argument("--kafka-bootstrap", required=True)
    parser.add_argument("--request-params", type=json.loads, default=None)
    args = parser.parse_args(argv)
    if args.produce:
        return produce_share(args.produce, args)
    if args.produce_streams:
        from bench.gpu.streams import produce_streams_share

        return produce_streams_share(args.produce_streams, args)
    return produce_paced_share(args.produce_paced, args)


if __name__ == "__main__":
    sys.exit(main())
