"""bench.promql: the PromQL subset the dashboard uses, against values worked out by hand.

The expected numbers follow Prometheus' documented semantics (rate as an
increase per second with counter resets, histogram_quantile's linear
interpolation within a bucket), so the drawn dashboard shows what Grafana would.
"""

from __future__ import annotations

import math

import pytest

from bench.promql import Binary, Scrapes, Selector, evaluate, metric_names, parse


def labels(**items: str) -> frozenset[tuple[str, str]]:
    return frozenset(items.items())


def history(*scrapes: tuple[float, list[tuple[str, dict[str, str], float]]]) -> Scrapes:
    out = Scrapes()
    for time_s, samples in scrapes:
        out.add(time_s, samples)
    return out


def test_parse_reads_selectors_aggregations_and_arithmetic() -> None:
    expr = parse(
        'sum(rate(a_sum{model=~"m.*", status!="ok"}[1m])) / sum(rate(a_count{model=~"m.*"}[1m]))'
    )

    assert isinstance(expr, Binary)
    assert expr.op == "/"
    assert metric_names(expr) == {"a_sum", "a_count"}
    assert parse("conveyor_ready") == Selector("conveyor_ready")
    assert parse('x{a="1"}[5s]') == Selector("x", (("a", "=", "1"),), 5.0)


def test_rate_is_the_increase_per_second_across_a_counter_reset() -> None:
    scrapes = history(
        (0.0, [("c_total", {"s": "ok"}, 10.0), ("c_total", {"s": "error"}, 1.0)]),
        (1.0, [("c_total", {"s": "ok"}, 30.0), ("c_total", {"s": "error"}, 1.0)]),
        (2.0, [("c_total", {"s": "ok"}, 5.0), ("c_total", {"s": "error"}, 2.0)]),  # restart
        (3.0, [("c_total", {"s": "ok"}, 25.0), ("c_total", {"s": "error"}, 2.0)]),
    )

    # Range (0 s, 3 s], its start left out as Prometheus does: the scrapes at 1, 2 and 3.
    # ok: 30 -> 5 (a reset: +5) -> 25 (+20), 25 in 2 s; error: 1 -> 2 -> 2.
    assert evaluate(parse("rate(c_total[3s])"), scrapes, 3) == {
        labels(s="ok"): 12.5,
        labels(s="error"): 0.5,
    }
    assert evaluate(parse('sum(rate(c_total{s!="error"}[3s]))'), scrapes, 3) == {frozenset(): 12.5}
    assert evaluate(parse("rate(c_total[2s])"), scrapes, 0) == {}  # one point: no rate yet


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = [("h_bucket", {"le": le}, n) for le, n in (("0.1", 0), ("0.5", 60), ("1", 90))]
    inf = [("h_bucket", {"le": "+Inf"}, 100.0)]
    scrapes = history((0.0, [*buckets, *inf]))

    # Rank 50 of 100 falls in (0.1, 0.5] holding 60: 0.1 + 0.4 * 50/60.
    median = evaluate(parse("histogram_quantile(0.5, h_bucket)"), scrapes, 0)
    assert isinstance(median, dict)
    assert median[frozenset()] == pytest.approx(0.1 + 0.4 * 50 / 60)
    # Rank 99 is past the highest finite bound: Prometheus answers that bound.
    assert evaluate(parse("histogram_quantile(0.99, h_bucket)"), scrapes, 0) == {frozenset(): 1.0}


def test_aggregations_group_by_the_labels_named() -> None:
    scrapes = history(
        (
            0.0,
            [
                ("lag", {"topic": "a", "partition": "0"}, 3.0),
                ("lag", {"topic": "a", "partition": "1"}, 4.0),
                ("lag", {"topic": "b", "partition": "0"}, 5.0),
            ],
        )
    )

    assert evaluate(parse("sum by (topic) (lag)"), scrapes, 0) == {
        labels(topic="a"): 7.0,
        labels(topic="b"): 5.0,
    }
    assert evaluate(parse("max(lag) by (topic)"), scrapes, 0) == {
        labels(topic="a"): 4.0,
        labels(topic="b"): 5.0,
    }
    assert evaluate(parse("sum(lag) / 2"), scrapes, 0) == {frozenset(): 6.0}
    divided = evaluate(parse("sum(lag) / sum(nothing)"), scrapes, 0)
    assert divided == {}  # no series on one side: no result, as in Prometheus
    zero = history((0.0, [("a", {}, 1.0), ("b", {}, 0.0)]))
    result = evaluate(parse("a / b"), zero, 0)
    assert isinstance(result, dict)
    assert math.isnan(result[frozenset()])
