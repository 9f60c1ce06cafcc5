"""``bench.cpu --only tabular``: feature records scored by the fraud demo's MLP.

The model is ``demo.models.fraud``'s MLP (TorchScript), served as ``tabular:PATH`` with
``--profile latency``; each request is one transaction's ``{"features": {...}}``. Three
measurements, one worker, in this order:

- **peak**: a backlog of ``peak_requests`` records, from the worker's first fetch until
  every score is in Redis (records/s of one process);
- **idle**: one record at a time (``IDLE_RATE`` a second, far apart from each other's
  work), the time from the record's append to its score's write to Redis, with its
  parts (``bench.stats.latency_parts``);
- **half**: open-loop load at half the peak, the same percentiles.

Goals (docs/benchmarks.md): idle p99 ≤ 10 ms, half-peak p99 ≤ 20 ms, peak ≥ 15,000
records/s per process.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from bench.services import all_results_in
from bench.stats import acked_summary, check_all_ok, latency_summary, parts_line
from demo.models.fraud import build, record, transactions
from producers.testing import produce, produce_at_rate, read_results, requests
from schemas import ContentType, OutgoingRecord

if TYPE_CHECKING:
    from bench.cpu import Bench

IDLE_RATE = 20.0  # a record every 50 ms: each one finds the worker idle
IDLE_P99_GOAL_MS = 10.0
HALF_P99_GOAL_MS = 20.0
PEAK_GOAL = 15_000.0
_OPTIONS = ("--profile", "latency")
_WAIT_S = 300.0


async def tabular(
    bench: Bench, peak_requests: int, idle_requests: int, seconds: float
) -> dict[str, Any]:
    """The scenario of the module doc; its report section."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-fraud-") as folder:
        _gbdt, mlp = build(Path(folder), train_rows=5000)
        spec = f"tabular:{mlp}"
        async with bench.fresh_model("tabular-peak") as (model, _topics, ids):
            records, ids[:] = _records(model, peak_requests, "p")
            peak = await bench.serve_backlog(bench.worker(spec, model, _OPTIONS), records, ids)
        levels = await _levels(bench, spec, idle_requests, float(peak["rate"]), seconds)
    idle, half = levels
    return {
        "what": "fraud demo MLP (TorchScript), one transaction's features a request, "
        "--profile latency; latency = record timestamp → result sent to Redis",
        "peak": peak,
        "idle": idle,
        "half": half,
        "goals": {
            "idle_p99_ms": IDLE_P99_GOAL_MS,
            "half_p99_ms": HALF_P99_GOAL_MS,
            "peak_records_s": PEAK_GOAL,
        },
        "met": {
            "idle": idle["p99_ms"] <= IDLE_P99_GOAL_MS,
            "half": half["p99_ms"] <= HALF_P99_GOAL_MS,
            "peak": float(peak["rate"]) >= PEAK_GOAL,
        },
    }


async def _levels(
    bench: Bench, spec: str, idle_requests: int, peak: float, seconds: float
) -> list[dict[str, Any]]:
    """One record at a time, then half the peak, through one warm worker."""
    levels = []
    async with bench.fresh_model("tabular-latency") as (model, topics, ids):
        config = bench.worker(spec, model, _OPTIONS)
        async with bench.launch(config, bench.log_dir / f"{model}.log") as worker:
            warm, warm_ids = _records(model, 50, "w")
            ids += warm_ids
            await produce(bench.services.kafka_bootstrap, topics.requests, warm, round_robin=True)
            await worker.unless_it_dies(all_results_in(bench.services, warm_ids, warm_ids, _WAIT_S))
            for name, rate, count in (
                ("idle", IDLE_RATE, idle_requests),
                ("half", peak / 2, max(20, int(peak / 2 * seconds))),
            ):
                records, level_ids = _records(model, count, name)
                ids += level_ids
                acked: list[float] = []
                sent = await produce_at_rate(
                    bench.services.kafka_bootstrap, topics.requests, records, rate, acked
                )
                await worker.unless_it_dies(
                    all_results_in(bench.services, level_ids, level_ids[-5:], _WAIT_S)
                )
                results = list((await read_results(bench.services.redis_url, level_ids)).values())
                check_all_ok(results, count, f"tabular {name}")
                level = {"target_rate": rate, "sent_rate": sent, "requests": count}
                level |= acked_summary(acked) | latency_summary(results)
                print(f"[bench] tabular {name}: p99 {level['p99_ms']:.1f} ms; {parts_line(level)}")
                levels.append(level)
    return levels


def _records(model: str, count: int, tag: str) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` requests, each one transaction of a fixed stream of 1,000."""
    data = transactions(1000, seed=5)
    payloads = [orjson.dumps({"features": record(data, n)}) for n in range(1000)]
    return requests(payloads, count, f"{model}-{tag}", ContentType.JSON, source="bench")
