"""Numbers from results and profiles: percentiles, rates, and where a worker's time went."""

from __future__ import annotations

import math
import pstats
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas import Result, Status, Timings

_REPO = str(Path(__file__).resolve().parents[1]) + "/"
_LIBRARY_ROOT = re.compile(r"^.*/(site-packages|lib/python3\.\d+)/")
# Threads waiting for work, and the event loop waiting for sockets: time spent
# idle, not cost. (socket send/recv stay in: on a busy 2-core box their time is
# mostly the wait to get the GIL back, which is a real per-request cost.)
_IDLE = (
    "<method 'get' of '_queue.SimpleQueue' objects>",
    "<method 'poll' of 'select.epoll' objects>",
    "<method 'acquire' of '_thread.lock' objects>",
    "<built-in method time.sleep>",
)
_AREAS = (  # (file path fragment, area), first match wins
    ("/workers/", "workers (pipeline, publisher, consumer)"),
    ("/schemas/", "schemas (contract codecs)"),
    ("/aiokafka/", "aiokafka (fetch, produce)"),
    ("/redis/", "redis client"),
    ("/pydantic", "pydantic"),
    ("/torch/", "torch"),
    ("/bench/", "identity model"),
    ("/asyncio/", "asyncio event loop"),
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
    """End-to-end (record timestamp → result ready) and batch compute percentiles, in ms."""
    latencies = [_timings(r).finished_ms - _timings(r).produced_ms for r in results]
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
    }


def batch_summary(results: Sequence[Result]) -> dict[str, float]:
    """Batches formed and compute time per batch, for a backlog run."""
    summary = latency_summary(results)
    return {
        k: summary[k] for k in ("batches", "mean_batch_size", "compute_p50_ms", "compute_p99_ms")
    }


def profile_summary(stats_path: Path, requests: int, top: int = 12) -> dict[str, Any]:
    """Where a profiled worker spent its busy time, per request.

    Self time (cProfile's ``tottime``) of every function, idle waits left out,
    divided by ``requests``: the top functions, and the same time summed by area.
    cProfile slows pure-Python code more than C code, so shares are the thing to
    read, not the absolute microseconds.
    """
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    busy: list[tuple[float, str, str]] = []
    for (file, line, func), (_cc, _calls, self_s, _cum_s, callers) in raw.items():
        if func in _IDLE:
            continue
        name = _where(file, line, func)
        if file == "~" and callers:
            # A C function alone says little (socket send, for whom?): name its main caller.
            top_caller = max(callers.items(), key=lambda kv: kv[1][2])[0]
            name += f" <- {_where(*top_caller)}"
        busy.append((self_s, name, _area(file)))
    total_s = sum(s for s, _name, _area_name in busy)
    areas: dict[str, float] = defaultdict(float)
    for self_s, _name, area in busy:
        areas[area] += self_s
    busy.sort(reverse=True)
    per_request_us = 1e6 / requests
    return {
        "requests": requests,
        "busy_s": total_s,
        "busy_us_per_request": total_s * per_request_us,
        "top_functions": [
            {"function": name, "us_per_request": s * per_request_us, "share": s / total_s}
            for s, name, _area_name in busy[:top]
        ],
        "by_area": [
            {"area": area, "us_per_request": s * per_request_us, "share": s / total_s}
            for area, s in sorted(areas.items(), key=lambda kv: -kv[1])
        ],
    }


def _timings(result: Result) -> Timings:
    if result.timings is None:
        raise RuntimeError(f"result {result.id} has no timings")
    return result.timings


def _where(file: str, line: int, func: str) -> str:
    if file == "~":
        return func  # a C function: its name says what it is
    short = _LIBRARY_ROOT.sub("", file).removeprefix(_REPO)
    return f"{short}:{line}({func})"


def _area(file: str) -> str:
    if file == "~":
        return "C builtins (sockets, json, ...)"
    for fragment, area in _AREAS:
        if fragment in file:
            return area
    return "other Python"
