"""The ``lone`` stage: one request at a time on an idle, ready host, then a backlog (goal 3b).

For each spec of ``--lone-models`` and each of ``--lone-variants`` (``defaults``: the
command as it is; ``latency``: ``--profile latency``; ``no_idle_rule``:
``--no-close-idle-batches``, the batch timer always waited, to show what the idle rule
buys), on one card: the default command (``--weights random``) with the variant's flags
after ``--worker-options``, ready and warmed with a few requests, then
``--lone-requests`` 224x224 JPEGs sent one after the other with the SDK as a user sends
them (``AsyncClient.submit``, then ``wait``), each round trip timed with
``time.perf_counter`` around both. Each round trip is split by its result's timings (the
request topic stamps the broker's append, so the record's timestamp is its append):

- ``acked``: ``submit`` to the broker's acknowledgement (the caller's produce);
- ``to_append``: the call to ``submit`` to the broker's append;
- ``to_worker``, ``to_batch``, ``in_model``, ``to_redis``: ``bench.stats.latency_parts``
  (append to the worker's fetch, the wait in the worker, the model, the publish);
- ``read``: the result sent to Redis to ``wait`` returning it.

Then, on the same host, a backlog of ``--e2e-count`` (``e2e.timed_backlog``): its
steady-state img/s, so each variant's throughput stands beside its latency. Goal 3b's
bound is the command's ``max_delay_ms`` + a batch-1 compute + 5 ms, the compute being the
worker's own: the p50 of its lone batches' ``inference_ms``. With ``--pin`` the SDK
client runs on the producers' cores. A row is written as each (model, variant) finishes,
so a run cut short keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from bench.gpu.config import Config
from bench.gpu.cores import _pin_services, _producer_cores
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import Load, timed_backlog
from bench.gpu.host import _fleet, _start_host, expected_processes, max_delay_ms_of
from bench.gpu.zoo import with_worker_options
from bench.stats import LATENCY_PARTS, durable_ms, latency_parts, percentile
from producers import AsyncClient
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import WORKER_COMMAND, WorkerProcess, until_all_ready
from schemas import Result, Status

LONE_MODELS = ("torchvision:resnet50", "timm:vit_base_patch16_224")
VARIANTS = {
    "defaults": "",
    "latency": "--profile latency",
    "no_idle_rule": "--no-close-idle-batches",
}
"""The variants' flags, after the user's ``--worker-options``."""
P99_GOAL_MS = 20.0
"""The bound on a lone request's p99 as the SDK's caller sees it (docs/benchmarks.md)."""
_SLACK_MS = 5.0  # goal 3b: max_delay + a batch-1 compute + 5 ms
_QUICK_REQUESTS = 5
_WAIT_S = 30.0


def stage_lone(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    _pin_services(args)
    corpus = next((c for c in corpora if c.name == "224x224"), None)
    if corpus is None:
        raise SystemExit("lone sends 224x224 JPEGs: add 224x224 to --corpora")
    out: dict[str, Any] = {}
    for spec in [s.strip() for s in args.lone_models.split(",") if s.strip()]:
        for variant in [v.strip() for v in args.lone_variants.split(",") if v.strip()]:
            key = f"{spec} {variant}"
            try:
                flags = VARIANTS[variant]
                row = asyncio.run(_row(dataclasses.replace(cfg, model=spec), corpus, args, flags))
            except Exception as exc:  # one row's failure is its row; the others still run
                row = {"error": f"{type(exc).__name__}: {exc}"}
            out[key] = row
            print(f"  lone {key}: {_line(row)}", flush=True)
            checkpoint(out)
    return out


@dataclasses.dataclass(frozen=True)
class Trip:
    """One request's round trip as the SDK's caller sees it."""

    sent_ms: float  # epoch ms just before ``submit``
    acked_ms: float  # ``submit``'s own time: to the broker's acknowledgement
    round_trip_ms: float  # ``submit`` and ``wait`` together
    read_at_ms: float  # epoch ms when ``wait`` returned
    result: Result


async def _row(cfg: Config, corpus: Corpus, args: argparse.Namespace, flags: str) -> dict[str, Any]:
    """The host of ``cfg.model`` with ``flags``: ready, warmed, lone requests, a backlog."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gpulone{run}"
    partitions = expected_processes(None, 1 if cfg.device.type == "cuda" else 0, args)
    # The broker stamps each request as it appends it: the record's timestamp is its append.
    stamp = {"message.timestamp.type": "LogAppendTime"}
    await create_model_topics(settings, model, partitions, configs={"requests": stamp})
    options = with_worker_options(args, flags)
    fleet = _fleet(cfg, model, options)
    count = min(args.lone_requests, _QUICK_REQUESTS) if args.quick else args.lone_requests
    try:
        host = _start_host(fleet, cfg, options, None, 1)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        async with AsyncClient(bootstrap=args.kafka_bootstrap, redis_url=args.redis_url) as client:
            send = _Sender(client, model, host, corpus, args.request_params or None)
            await send.each(f"{run}-w", 2 if args.quick else 4 * partitions)  # warm, untimed
            trips = await _on_producer_cores(args, send.each(f"{run}-l", count))
        row = {
            "command": " ".join(host.config.argv()[len(WORKER_COMMAND) :]),
            "processes": len(host.children()) or 1,
            "requests": count,
        } | lone_summary(trips, max_delay_ms_of(host.config.argv()))
        load = Load(model, run, partitions, host, None, 1)
        backlog = await timed_backlog(args, load, corpus, f"{run}-b", cfg.e2e_count)
        return row | {
            "backlog_count": cfg.e2e_count,
            "backlog_img_s": backlog["img_s"],
            "backlog_mean_batch": backlog["mean_batch"],
            "backlog_gpu_util_pct": backlog["gpu_util_pct"],
        }
    finally:
        name = f"{cfg.model}-{flags or 'defaults'}".replace(":", "-").replace(" ", "")
        (args.out / f"lone-{name}.log").write_text(fleet.logs())
        await fleet.aclose()
        await delete_model_topics(settings, model)


@dataclasses.dataclass(frozen=True)
class _Sender:
    """Requests sent one after the other, each once the previous one's result is back."""

    client: AsyncClient
    model: str
    host: WorkerProcess
    corpus: Corpus
    params: dict[str, Any] | None

    async def each(self, prefix: str, count: int) -> list[Trip]:
        trips = []
        for n, image in enumerate(self.corpus.take(count)):
            sent_ms = time.time() * 1000
            started = time.perf_counter()
            request_id = await self.client.submit(
                image, model=self.model, params=self.params, request_id=f"{prefix}-{n}"
            )
            acked = time.perf_counter()
            result = await self.host.unless_it_dies(self.client.wait(request_id, _WAIT_S))
            done = time.perf_counter()
            trip = Trip(
                sent_ms=sent_ms,
                acked_ms=(acked - started) * 1000,
                round_trip_ms=(done - started) * 1000,
                read_at_ms=time.time() * 1000,
                result=result,
            )
            trips.append(trip)
        return trips


async def _on_producer_cores(args: argparse.Namespace, work: Any) -> list[Trip]:
    """Await ``work`` on the producers' cores with ``--pin`` (this thread's affinity)."""
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, _producer_cores(args))
    try:
        trips: list[Trip] = await work
        return trips
    finally:
        os.sched_setaffinity(0, mine)


def lone_summary(trips: Sequence[Trip], max_delay_ms: float) -> dict[str, Any]:
    """The round trips' p50 and p99, each part's (module doc), and goal 3b's bound."""
    results = [t.result for t in trips]
    ok = [r for r in results if r.status is Status.ok and r.timings is not None]
    round_trip = [t.round_trip_ms for t in trips]
    timed = [(t, t.result.timings) for t in trips if t.result.timings is not None]
    mine = {
        "acked": [t.acked_ms for t in trips],
        "to_append": [timings.produced_ms - t.sent_ms for t, timings in timed],
        "read": [t.read_at_ms - durable_ms(t.result) for t, _ in timed],
    }
    batches = [timings for _, timings in timed if timings.batch_size > 0]
    ones = [timings.inference_ms for timings in batches if timings.batch_size == 1]
    compute = statistics.median(ones) if ones else math.nan
    bound = max_delay_ms + compute + _SLACK_MS
    row: dict[str, Any] = {
        "answered": len(results),
        "ok": len(ok),
        "round_trip_p50_ms": percentile(round_trip, 50),
        "round_trip_p99_ms": percentile(round_trip, 99),
    }
    for name, values in mine.items():
        row |= {f"{name}_p50_ms": percentile(values, 50), f"{name}_p99_ms": percentile(values, 99)}
    row |= latency_parts(ok) if ok else {}
    return row | {
        "lone_mean_batch": statistics.fmean(b.batch_size for b in batches) if batches else math.nan,
        "max_delay_ms": max_delay_ms,
        "batch1_compute_ms": compute,
        "batch1_compute_from": "the worker's own inference_ms of its lone batches of one, p50",
        "bound_ms": bound,
        "p50_met": row["round_trip_p50_ms"] <= bound,
        "p99_within_20ms": row["round_trip_p99_ms"] <= P99_GOAL_MS,
    }


def _line(row: dict[str, Any]) -> str:
    """One row as a line: the round trip against the bound, its parts, the backlog's rate."""
    if "error" in row:
        return str(row["error"])
    parts = ", ".join(
        f"{name} {row[f'{name}_p50_ms']:.1f}/{row[f'{name}_p99_ms']:.1f}"
        for name in ("acked", "to_append", *LATENCY_PARTS, "read")
        if f"{name}_p50_ms" in row
    )
    return (
        f"{row['ok']}/{row['requests']} ok, round trip p50 {row['round_trip_p50_ms']:.1f} "
        f"p99 {row['round_trip_p99_ms']:.1f} ms (bound {row['bound_ms']:.1f}: p50 "
        f"{'met' if row['p50_met'] else 'not met'}; p99 <= {P99_GOAL_MS:.0f}: "
        f"{row['p99_within_20ms']}); {parts} ms (p50/p99); backlog "
        f"{row['backlog_img_s']:,.0f} img/s, batches of {row['backlog_mean_batch']:.1f}"
    )
