"""Numbers from results and profiles: percentiles, rates, and where a worker's time went."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas import Result, Status, Timings

_REPO = str(Path(__file__).resolve().parents[1]) + "/"
_LIBRARY_ROOT = re.compile(r"^.*/(site-packages|lib/python3\.\d+)/")
# Frames that wait rather than work, should py-spy catch a thread in one.
_IDLE_FUNCTIONS = frozenset({"select", "poll", "wait", "_worker", "get"})
# One frame of py-spy's raw output: "function (path/to/file.py:line)".
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")
_AREAS = (  # (path prefix as py-spy shows it, area), first match wins
    ("workers/", "workers (pipeline, publisher, consumer)"),
    ("schemas/", "schemas (contract codecs)"),
    ("aiokafka/", "aiokafka (fetch, produce)"),
    ("redis/", "redis client"),
    ("pydantic", "pydantic"),
    ("torch/", "torch"),
    ("bench/", "identity model"),
    ("asyncio/", "asyncio event loop"),
    ("selectors.py", "asyncio event loop"),
)


def percentile(values: Sequence[float], percent: float) -> float:
    """Nearest-rank percentile: the smallest value with ``percent``% of values at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = math.ceil(percent / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def check_all_ok(results: Sequence[Result], expected: int, what: str) -> None:
    """Raise ``RuntimeError`` unless ``expected`` results came back, all ``ok``."""
    bad = [r for r in results if r.status is not Status.ok]
    if len(results) != expected or bad:
        sample = bad[0].error if bad else None
        raise RuntimeError(
            f"{what}: {len(results)} of {expected} results, {len(bad)} not ok (e.g. {sample})"
        )


def backlog_rate(results: Sequence[Result], all_seen_at: float) -> float:
    """Requests/s from the worker's first fetch of a backlog to all results seen in Redis."""
    first_received_s: float = min(_timings(r).received_ms for r in results) / 1000.0
    return len(results) / (all_seen_at - first_received_s)


def latency_summary(results: Sequence[Result]) -> dict[str, float]:
    """End-to-end and batch compute percentiles, in ms.

    End to end is from the record timestamp to the result being sent to Redis
    (``published_ms``; durable one Redis round trip later); results of workers
    that predate that field fall back to ``finished_ms`` (model done).
    """
    latencies = [durable_ms(r) - _timings(r).produced_ms for r in results]
    batches = {(r.worker, _timings(r).batch_start_ms): r for r in results}
    compute = [_timings(r).inference_ms for r in batches.values()]
    return {
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
        "batches": len(batches),
        "mean_batch_size": len(results) / len(batches),
        "compute_p50_ms": percentile(compute, 50),
        "compute_p99_ms": percentile(compute, 99),
    } | latency_parts(results)


LATENCY_PARTS = ("to_worker", "to_batch", "in_model", "to_redis")
"""The parts of the end-to-end time, in order (``latency_parts``)."""


def latency_parts(results: Sequence[Result]) -> dict[str, float]:
    """Where the end-to-end time went: p50 and p99 of each part, in ms, keyed
    ``<part>_p50_ms`` and ``<part>_p99_ms``. For each result, from its timings:

    - ``to_worker``: record timestamp to the worker's fetch (producer, broker, fetch);
    - ``to_batch``: fetch to its batch's start (parse, decode, waiting for a batch);
    - ``in_model``: batch start to the result being ready (the batch's trip through the
      model's stages, the waits between them included);
    - ``to_redis``: ready to sent to Redis (the publish queue).

    The parts of one result add up to its end-to-end time; their percentiles need not.
    Results that never reached a model count in the first and last part only. Beside
    them, ``in_worker_p50_ms`` and ``in_worker_p99_ms``: fetch to sent to Redis, the
    three parts the worker spends (all but ``to_worker``) as one time per result.
    """
    parts: dict[str, list[float]] = {name: [] for name in (*LATENCY_PARTS, "in_worker")}
    for result in results:
        t = _timings(result)
        parts["to_worker"].append(t.received_ms - t.produced_ms)
        parts["in_worker"].append(durable_ms(result) - t.received_ms)
        if t.batch_start_ms is not None:
            parts["to_batch"].append(t.batch_start_ms - t.received_ms)
            parts["in_model"].append(t.finished_ms - t.batch_start_ms)
        parts["to_redis"].append(durable_ms(result) - t.finished_ms)
    summary: dict[str, float] = {}
    for name, values in parts.items():
        summary[f"{name}_p50_ms"] = percentile(values, 50)
        summary[f"{name}_p99_ms"] = percentile(values, 99)
    return summary


def batch_summary(results: Sequence[Result]) -> dict[str, float]:
    """Batches formed and compute time per batch, for a backlog run."""
    summary = latency_summary(results)
    return {
        k: summary[k] for k in ("batches", "mean_batch_size", "compute_p50_ms", "compute_p99_ms")
    }


MODEL_STAGE_KEYS = ("model_busy_pct", "idle_gap_p50_ms", "idle_gap_p99_ms")


def model_stage(results: Sequence[Result], low_ms: float, high_ms: float) -> dict[str, float]:
    """Each worker's model stage between ``low_ms`` and ``high_ms``, from its batches'
    timings (``batch_start_ms`` to ``+ inference_ms``, cut to the window; pipelined
    batches overlap): the share of the time some batch was in it (mean over workers), and
    the idle gaps between one batch leaving it and the next entering (p50/p99 over all
    workers, ms)."""
    spans: dict[str, set[tuple[float, float]]] = defaultdict(set)
    for result in results:
        timings = result.timings
        if timings is None or timings.batch_start_ms is None:
            continue  # never reached a model
        start, end = timings.batch_start_ms, timings.batch_start_ms + timings.inference_ms
        if start <= high_ms and end >= low_ms:
            spans[result.worker].add((max(start, low_ms), min(end, high_ms)))
    busy, gaps = [], []
    for worker_spans in spans.values():
        merged: list[list[float]] = []
        for start, end in sorted(worker_spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                if merged:
                    gaps.append(start - merged[-1][1])
                merged.append([start, end])
        busy.append(sum(end - start for start, end in merged) / (high_ms - low_ms))
    mean_busy = 100.0 * sum(busy) / len(busy) if busy else math.nan
    values = (mean_busy, percentile(gaps, 50), percentile(gaps, 99))
    return dict(zip(MODEL_STAGE_KEYS, values, strict=True))


def pyspy_summary(samples_path: Path, requests: int, top: int = 12) -> dict[str, Any]:
    """Where a worker spent its busy time, per request, from py-spy's collapsed stacks.

    Each sample is charged to the innermost frame of its stack (self time); samples
    of threads waiting for work (idle) are left out by py-spy itself. Shares are
    exact for the samples taken; microseconds per request assume the samples cover
    ``requests`` requests (py-spy samples at a fixed rate, so the busy time is the
    sample count over that rate: see ``rate_hz``).
    """
    rate_hz = 200.0
    functions: dict[str, float] = defaultdict(float)
    areas: dict[str, float] = defaultdict(float)
    total = 0.0
    for line in samples_path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = float(count_text)
        leaf = stack.rsplit(";", 1)[-1]
        match = _FRAME.match(leaf)
        func, file = (match.group(1), match.group(2)) if match else (leaf, "~")
        if func in _IDLE_FUNCTIONS:
            continue
        functions[f"{func} ({_LIBRARY_ROOT.sub('', file).removeprefix(_REPO)})"] += count
        areas[_area(file)] += count
        total += count
    per_request_us = 1e6 / rate_hz / requests
    return {
        "profiler": f"py-spy record --rate {rate_hz:.0f} --threads (sampling)",
        "requests": requests,
        "samples": total,
        "busy_us_per_request": total * per_request_us,
        "top_functions": [
            {"function": name, "us_per_request": n * per_request_us, "share": n / total}
            for name, n in sorted(functions.items(), key=lambda kv: -kv[1])[:top]
        ],
        "by_area": [
            {"area": area, "us_per_request": n * per_request_us, "share": n / total}
            for area, n in sorted(areas.items(), key=lambda kv: -kv[1])
        ],
    }


def acked_summary(acked_ms: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of the acknowledgements after due time ``produce_at_rate`` collects."""
    return {"acked_p50_ms": percentile(acked_ms, 50), "acked_p99_ms": percentile(acked_ms, 99)}


def parts_line(summary: dict[str, float]) -> str:
    """``latency_parts`` in one line: each part's p50/p99, then ``acked_summary``'s if there."""
    shown = (
        f"{n} {summary[f'{n}_p50_ms']:.1f}/{summary[f'{n}_p99_ms']:.1f}" for n in LATENCY_PARTS
    )
    line = ", ".join(shown) + " ms (p50/p99)"
    if "acked_p50_ms" in summary:
        acked = f"{summary['acked_p50_ms']:.1f}/{summary['acked_p99_ms']:.1f}"
        line += f"; acked by the broker {acked} ms after due"
    return line


def durable_ms(result: Result) -> float:
    """When the result was sent to Redis (``finished_ms`` for workers older than that field)."""
    timings = _timings(result)
    return timings.finished_ms if timings.published_ms is None else timings.published_ms


def _timings(result: Result) -> Timings:
    if result.timings is None:
        raise RuntimeError(f"result {result.id} has no timings")
    return result.timings


def _area(file: str) -> str:
    if file == "~" or not file.endswith(".py"):
        return "native (C extensions, sockets)"
    short = _LIBRARY_ROOT.sub("", file).removeprefix(_REPO)
    for prefix, area in _AREAS:
        if short.startswith(prefix):
            return area
    return "other Python"
