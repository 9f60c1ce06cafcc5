"""bench.stats: where the end-to-end time of results went."""

from __future__ import annotations

import math

import pytest

from bench.stats import (
    LATENCY_PARTS,
    MODEL_STAGE_KEYS,
    acked_summary,
    latency_parts,
    latency_summary,
    model_stage,
    parts_line,
)
from schemas import Result, Status, Timings


def result(n: int, *, fetched: float, started: float | None, ready: float, sent: float) -> Result:
    """A result whose request was produced at t=1000 ms, with its other instants after it."""
    timings = Timings(
        produced_ms=1000,
        received_ms=1000 + fetched,
        batch_start_ms=None if started is None else 1000 + started,
        finished_ms=1000 + ready,
        queue_ms=(started if started is not None else ready) - fetched,
        inference_ms=3.0,
        batch_size=0 if started is None else 1,
        published_ms=1000 + sent,
    )
    return Result(
        id=f"r-{n}",
        status=Status.ok,
        model="m",
        model_version="1",
        outputs=[],
        timings=timings,
        worker=f"w{n}",
    )


def test_the_parts_of_one_result_add_up_to_its_latency() -> None:
    one = [result(0, fetched=2.0, started=7.0, ready=15.0, sent=16.5)]
    parts = latency_parts(one)
    assert [parts[f"{name}_p50_ms"] for name in LATENCY_PARTS] == [2.0, 5.0, 8.0, 1.5]
    assert sum(parts[f"{name}_p99_ms"] for name in LATENCY_PARTS) == latency_summary(one)["p99_ms"]


def test_each_part_has_its_own_percentiles() -> None:
    # 99 quick results and one slow to reach the worker: the slow part shows at p99 only.
    results = [result(n, fetched=1.0, started=2.0, ready=3.0, sent=4.0) for n in range(99)]
    results.append(result(99, fetched=50.0, started=51.0, ready=52.0, sent=53.0))
    parts = latency_parts(results)
    assert parts["to_worker_p50_ms"] == 1.0
    assert parts["to_worker_p99_ms"] == 1.0  # nearest rank: the 99th of 100 values
    results.append(result(100, fetched=60.0, started=61.0, ready=62.0, sent=63.0))
    assert latency_parts(results)["to_worker_p99_ms"] == 50.0
    assert latency_parts(results)["in_model_p99_ms"] == 1.0


def test_the_time_in_the_worker_runs_from_fetch_to_redis_per_result() -> None:
    # Slow to batch in one result, slow in the model in another: each part's p99 is the
    # slow one, but no result spent both, so the worker's own p99 is below their sum.
    results = [result(n, fetched=1.0, started=2.0, ready=3.0, sent=4.0) for n in range(96)]
    results += [result(n, fetched=1.0, started=30.0, ready=31.0, sent=32.0) for n in (96, 97)]
    results += [result(n, fetched=1.0, started=2.0, ready=30.0, sent=31.0) for n in (98, 99)]
    parts = latency_parts(results)
    assert (parts["to_batch_p99_ms"], parts["in_model_p99_ms"], parts["to_redis_p99_ms"]) == (
        29.0,
        28.0,
        1.0,
    )
    assert parts["in_worker_p50_ms"] == 3.0
    assert parts["in_worker_p99_ms"] == 31.0  # not 58, the sum of the parts' p99s


def test_results_that_never_reached_a_model_count_outside_the_model_parts() -> None:
    parts = latency_parts([result(0, fetched=2.0, started=None, ready=4.0, sent=5.0)])
    assert parts["to_worker_p50_ms"] == 2.0
    assert parts["to_redis_p50_ms"] == 1.0
    assert math.isnan(parts["to_batch_p50_ms"])
    assert math.isnan(parts["in_model_p50_ms"])


def test_a_result_without_timings_is_refused() -> None:
    bare = Result(id="r-0", status=Status.ok, model="m", model_version="1", worker="w")
    with pytest.raises(RuntimeError, match="no timings"):
        latency_parts([bare])


def test_the_line_names_every_part_in_order() -> None:
    line = parts_line(latency_parts([result(0, fetched=2.0, started=7.0, ready=15.0, sent=16.5)]))
    assert (
        line
        == "to_worker 2.0/2.0, to_batch 5.0/5.0, in_model 8.0/8.0, to_redis 1.5/1.5 ms (p50/p99)"
    )


def test_the_line_ends_with_the_acknowledgements_when_they_were_collected() -> None:
    parts = latency_parts([result(0, fetched=2.0, started=7.0, ready=15.0, sent=16.5)])
    line = parts_line(parts | acked_summary([1.0, 3.0]))
    assert line.endswith("ms (p50/p99); acked by the broker 1.0/3.0 ms after due")


def batch(worker: str, start: float, took: float, n: int) -> Result:
    """One request of a batch that entered the model at ``start`` ms and took ``took``."""
    timings = Timings(
        produced_ms=0, received_ms=0.0, batch_start_ms=start, finished_ms=start + took,
        queue_ms=start, inference_ms=took, batch_size=2, published_ms=start + took + 1,
    )  # fmt: skip
    return Result(
        id=f"{worker}-{n}", status=Status.ok, model="m", model_version="1", outputs=[],
        timings=timings, worker=worker,
    )  # fmt: skip


def test_the_model_stage_counts_overlapping_batches_once_and_the_gaps_between() -> None:
    results = [
        # w1: [0, 10] and [5, 20] overlap (pipelined), then [30, 40]: busy 30 of 100, gap 10
        batch("w1", 0, 10, 0), batch("w1", 0, 10, 1), batch("w1", 5, 15, 2),
        batch("w1", 30, 10, 3),
        # w2: [0, 50] then [60, 100]: busy 90 of 100, gap 10; [150, ...] is outside
        batch("w2", 0, 50, 4), batch("w2", 60, 40, 5), batch("w2", 150, 5, 6),
    ]  # fmt: skip
    stage = model_stage(results, 0.0, 100.0)
    assert stage["model_busy_pct"] == pytest.approx((30 + 90) / 2)
    assert stage["idle_gap_p50_ms"] == 10.0
    assert stage["idle_gap_p99_ms"] == 10.0
    assert list(stage) == list(MODEL_STAGE_KEYS)


def test_batches_across_the_window_edges_count_inside_it() -> None:
    stage = model_stage([batch("w", -20, 30, 0), batch("w", 80, 50, 1)], 0.0, 100.0)
    assert stage["model_busy_pct"] == pytest.approx(10.0 + 20.0)
    assert stage["idle_gap_p50_ms"] == 70.0  # from 10 to 80
