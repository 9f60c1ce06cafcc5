"""Metrics: the values operators alert on, the rate behind the autoscaling signal."""

from __future__ import annotations

import math
import sys

import prometheus_client
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from schemas import Status
from tests.fakes import FakeClock
from workers.batching.batcher import CloseReason
from workers.observe.instruments import BulkHistogram, RateMeter, drain_seconds
from workers.observe.metrics import Metrics, cuda_memory_allocated

MODEL = {"model": "digits"}
VERSIONED = (
    "conveyor_requests_total",
    "conveyor_queue_wait_seconds",
    "conveyor_inference_seconds",
    "conveyor_end_to_end_seconds",
)
"""Families labelled with the version and role too: a worker before its model loaded has
version "" and, unless told, the primary role."""


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    if name.startswith(VERSIONED):
        labels = {"version": "", "role": "primary", **labels}
    return metrics.registry.get_sample_value(name, {**MODEL, **labels})


# -- RateMeter -------------------------------------------------------------------------------


def test_rate_is_zero_before_any_event() -> None:
    assert RateMeter(window_s=10).rate(5.0) == 0.0


def test_steady_rate_over_the_window() -> None:
    meter = RateMeter(window_s=10, buckets=10)
    for second in range(30):
        meter.add(100, float(second))
    assert meter.rate(29.5) == pytest.approx(100, rel=0.15)


def test_young_meter_divides_by_its_age_not_the_window() -> None:
    meter = RateMeter(window_s=60, buckets=60)
    meter.add(50, 0.0)
    meter.add(50, 4.0)
    assert meter.rate(5.0) == pytest.approx(100 / 5.0)


def test_one_burst_is_not_divided_by_less_than_a_slot() -> None:
    meter = RateMeter(window_s=10, buckets=10)
    meter.add(1000, 3.0)
    assert meter.rate(3.0) == pytest.approx(1000 / 1.0)


def test_old_counts_leave_the_window() -> None:
    meter = RateMeter(window_s=10, buckets=10)
    meter.add(500, 0.0)
    meter.add(10, 15.0)
    assert meter.rate(15.5) == pytest.approx(10 / 10)
    assert meter.rate(40.0) == 0.0


def test_nonpositive_counts_are_ignored() -> None:
    meter = RateMeter(window_s=10)
    meter.add(0, 1.0)
    meter.add(-5, 2.0)
    assert meter.rate(3.0) == 0.0


@pytest.mark.parametrize(("window_s", "buckets"), [(0, 10), (-1, 10), (10, 0)])
def test_rate_meter_rejects_bad_shape(window_s: float, buckets: int) -> None:
    with pytest.raises(ValueError, match="window_s"):
        RateMeter(window_s, buckets)


@pytest.mark.parametrize(
    ("lag", "rate", "expected"),
    [(0, 0.0, 0.0), (-3, 10.0, 0.0), (100, 0.0, math.inf), (100, 50.0, 2.0)],
)
def test_drain_seconds(lag: int, rate: float, expected: float) -> None:
    assert drain_seconds(lag, rate) == expected


# -- BulkHistogram -----------------------------------------------------------------------------


def test_bulk_histogram_matches_prometheus_client() -> None:
    buckets = (0.01, 0.1, 1.0)
    values = [0.0, 0.005, 0.01, 0.0100001, 0.1, 0.5, 1.0, 7.0, 1e9]  # bounds are inclusive
    registry = CollectorRegistry()
    bulk = BulkHistogram("bulk_seconds", "x", buckets, MODEL)
    registry.register(bulk)
    reference = Histogram("ref_seconds", "x", registry=registry, buckets=buckets)
    bulk.observe_many(values)
    for value in values:
        reference.observe(value)
    for le in ("0.01", "0.1", "1.0", "+Inf"):
        expected = registry.get_sample_value("ref_seconds_bucket", {"le": le})
        assert registry.get_sample_value("bulk_seconds_bucket", {**MODEL, "le": le}) == expected
    assert registry.get_sample_value("bulk_seconds_count", MODEL) == len(values)
    assert registry.get_sample_value("bulk_seconds_sum", MODEL) == pytest.approx(sum(values))


# -- Metrics -----------------------------------------------------------------------------------


def test_every_status_and_close_reason_exists_at_zero() -> None:
    metrics = Metrics("digits")
    for status in Status:
        assert sample(metrics, "conveyor_requests_total", status=status.value) == 0
    for reason in CloseReason:
        assert sample(metrics, "conveyor_batches_total", reason=reason.value) == 0


def test_results_by_status_and_end_to_end() -> None:
    metrics = Metrics("digits")
    metrics.observe_results({"ok": 3, "error": 1, "expired": 0}, [0.02, 0.2, 2.0, -0.5])
    metrics.observe_results({"ok": 2}, [0.03, 0.04])
    assert sample(metrics, "conveyor_requests_total", status="ok") == 5
    assert sample(metrics, "conveyor_requests_total", status="error") == 1
    assert sample(metrics, "conveyor_end_to_end_seconds_count") == 6
    # Producer clock skew gives a negative time; it counts in the lowest bucket.
    assert sample(metrics, "conveyor_end_to_end_seconds_bucket", le="0.005") == 1
    assert sample(metrics, "conveyor_end_to_end_seconds_sum") == pytest.approx(2.29)


def test_batches() -> None:
    metrics = Metrics("digits")
    metrics.batch_closed(CloseReason.FULL)
    metrics.batch_closed(CloseReason.FULL)
    metrics.batch_closed(CloseReason.DEADLINE)
    metrics.observe_batch(32, [0.001] * 31 + [0.2], 0.015)
    metrics.observe_batch(5, [0.004] * 5, 0.003)
    assert sample(metrics, "conveyor_batches_total", reason="full") == 2
    assert sample(metrics, "conveyor_batches_total", reason="deadline") == 1
    assert sample(metrics, "conveyor_batch_size_bucket", le="4.0") == 0
    assert sample(metrics, "conveyor_batch_size_bucket", le="8.0") == 1
    assert sample(metrics, "conveyor_batch_size_sum") == 37
    assert sample(metrics, "conveyor_inference_seconds_count") == 2
    assert sample(metrics, "conveyor_queue_wait_seconds_count") == 37
    assert sample(metrics, "conveyor_queue_wait_seconds_bucket", le="0.1") == 36


def test_once_serving_the_series_are_the_versions_and_say_so() -> None:
    metrics = Metrics("digits", role="canary")
    metrics.serving("digits-v2")
    metrics.observe_results({"ok": 4, "error": 1}, [0.02] * 5)
    metrics.observe_batch(4, [0.001] * 4, 0.01)
    labels = {"version": "digits-v2", "role": "canary"}
    assert sample(metrics, "conveyor_requests_total", status="ok", **labels) == 4
    assert sample(metrics, "conveyor_requests_total", status="error", **labels) == 1
    assert sample(metrics, "conveyor_requests_total", status="expired", **labels) == 0
    assert sample(metrics, "conveyor_end_to_end_seconds_count", **labels) == 5
    assert sample(metrics, "conveyor_queue_wait_seconds_count", **labels) == 4
    assert sample(metrics, "conveyor_inference_seconds_count", **labels) == 1
    assert sample(metrics, "conveyor_model_info", **labels) == 1
    # The series of the version not known yet are gone, not left at 0 beside the real ones.
    text = metrics.render().decode()
    assert 'version=""' not in text
    assert metrics.totals().by_status == {"ok": 4, "error": 1}


def test_records_left_to_the_other_group_and_the_share() -> None:
    metrics = Metrics("digits")
    metrics.skipped(90, 1000)
    metrics.skipped(10, 5000)
    assert sample(metrics, "conveyor_skipped_total") == 100
    assert sample(metrics, "conveyor_canary_share") == 0.5


def test_dead_letters_duplicates_and_in_flight() -> None:
    metrics = Metrics("digits")
    metrics.dead_letters(2)
    metrics.dead_letters(0)
    metrics.duplicates(3)
    metrics.set_in_flight(40)
    metrics.set_in_flight(12)
    assert sample(metrics, "conveyor_dead_letters_total") == 2
    assert sample(metrics, "conveyor_redeliveries_total") == 3
    assert sample(metrics, "conveyor_in_flight_requests") == 12


def test_lag_of_revoked_partitions_disappears() -> None:
    metrics = Metrics("digits")
    topic = "conveyor.digits.requests"
    metrics.set_lag({(topic, 0): 10, (topic, 1): 20})
    metrics.set_lag({(topic, 1): 5, (topic, 2): 7})
    assert sample(metrics, "conveyor_consumer_lag", topic=topic, partition="0") is None
    assert sample(metrics, "conveyor_consumer_lag", topic=topic, partition="1") == 5
    assert sample(metrics, "conveyor_consumer_lag", topic=topic, partition="2") == 7


def test_drain_estimate_is_lag_over_recent_throughput() -> None:
    clock = FakeClock(1000.0)
    metrics = Metrics("digits", clock=clock, rate_window_s=10)
    topic = "conveyor.digits.requests"
    for _ in range(10):  # 200 answers a second for 10 seconds
        metrics.observe_results({"ok": 200}, [])
        clock.now += 1.0
    metrics.set_lag({(topic, 0): 600, (topic, 1): 400})
    assert sample(metrics, "conveyor_backlog_drain_seconds") == pytest.approx(5.0, rel=0.15)
    clock.now += 60  # nothing answered for a minute while records wait: stalled
    metrics.render()
    assert sample(metrics, "conveyor_backlog_drain_seconds") == math.inf
    metrics.set_lag({})
    assert sample(metrics, "conveyor_backlog_drain_seconds") == 0


def test_gpu_memory_only_when_there_is_a_gpu() -> None:
    without = Metrics("digits", gpu_memory=lambda: None)
    without.render()
    assert sample(without, "conveyor_gpu_memory_allocated_bytes") is None
    with_gpu = Metrics("digits", gpu_memory=lambda: 3 << 30)
    with_gpu.render()
    assert sample(with_gpu, "conveyor_gpu_memory_allocated_bytes") == 3 << 30


def test_cuda_memory_allocated_reads_torch() -> None:
    assert "torch" in sys.modules  # imported by this module, so the lookup finds it
    allocated = cuda_memory_allocated()
    if torch.cuda.is_available():
        assert isinstance(allocated, int)
    else:
        assert allocated is None


def test_render_is_valid_exposition_in_a_private_registry() -> None:
    first, second = Metrics("digits"), Metrics("digits")  # no clash: separate registries
    first.observe_results({"ok": 1}, [0.1])
    first.set_lag({("t", 0): 3})
    first.set_ready(True)
    first.set_loop_lag(0.002)
    families = {f.name: f for f in text_string_to_metric_families(first.render().decode())}
    ours = {name for name in families if name.startswith("conveyor_")}
    assert ours >= {
        "conveyor_requests",
        "conveyor_batches",
        "conveyor_batch_size",
        "conveyor_queue_wait_seconds",
        "conveyor_inference_seconds",
        "conveyor_end_to_end_seconds",
        "conveyor_in_flight_requests",
        "conveyor_consumer_lag",
        "conveyor_backlog_drain_seconds",
        "conveyor_dead_letters",
        "conveyor_redeliveries",
        "conveyor_ready",
        "conveyor_event_loop_lag_seconds",
    }
    for name in ours:
        for s in families[name].samples:
            assert s.labels["model"] == "digits", s
    assert families["conveyor_ready"].samples[0].value == 1
    assert second.render().count(b"conveyor_requests_total{") == len(Status)
    default = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("conveyor_") for name in default)


def test_totals_read_back_what_the_counters_counted() -> None:
    metrics = Metrics("digits")
    assert metrics.totals().answered == 0
    metrics.observe_results({"ok": 3, "error": 1, "expired": 0}, [0.1] * 4)
    metrics.observe_results({"ok": 2}, [0.1] * 2)
    metrics.duplicates(2)
    metrics.handed_back(5)
    totals = metrics.totals()
    assert totals.by_status == {"ok": 5, "error": 1}
    assert (totals.answered, totals.duplicates, totals.handed_back) == (6, 2, 5)
