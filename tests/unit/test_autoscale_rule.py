"""bench.autoscale.ScaleRule: the HPA's arithmetic for KEDA's Kafka lag trigger, clocked by hand."""

from __future__ import annotations

import pytest
import yaml

from bench.autoscale import SCALED_OBJECT, ScalePolicy, ScaleRule, caught_up

POLICY = ScalePolicy(
    lag_threshold=100,
    min_workers=1,
    max_workers=6,
    up_pods=2,
    up_period_s=60,
    down_pods=1,
    down_period_s=120,
    down_window_s=300,
)


@pytest.mark.parametrize(
    ("lag", "current", "wanted"),
    [
        (0, 3, 1),  # never below the minimum
        (1, 1, 1),
        (101, 1, 1),  # within 10 % of the target: left alone
        (111, 1, 2),  # ceil(lag / threshold)
        (450, 2, 5),
        (10_000, 2, 6),  # never above the maximum (the partition count)
        (290, 3, 3),
        (320, 3, 3),
        (340, 3, 4),
        (260, 3, 3),
        (250, 3, 3),  # 250 / 300 is 17 % under, but ceil(2.5) is 3 anyway
    ],
)
def test_recommendation(lag: int, current: int, wanted: int) -> None:
    assert ScaleRule(POLICY).recommend(lag, current) == wanted


def test_scale_up_is_limited_per_period() -> None:
    rule = ScaleRule(POLICY)
    assert rule.decide(0, lag=10_000, current=1) == 3  # 2 pods per period
    assert rule.decide(15, lag=10_000, current=3) == 3  # the period's 2 are used
    assert rule.decide(59, lag=10_000, current=3) == 3
    assert rule.decide(61, lag=10_000, current=3) == 5  # a new period
    assert rule.decide(121, lag=10_000, current=5) == 6  # the maximum


def test_scale_down_waits_for_the_window_then_goes_one_at_a_time() -> None:
    rule = ScaleRule(POLICY)
    assert rule.decide(0, lag=600, current=6) == 6
    # The backlog is gone, but the highest recommendation of the last 300 s was 6.
    for t in range(15, 300, 15):
        assert rule.decide(t, lag=0, current=6) == 6
    assert rule.decide(301, lag=0, current=6) == 5  # the window has passed: one pod
    assert rule.decide(316, lag=0, current=5) == 5  # one per 120 s
    assert rule.decide(422, lag=0, current=5) == 4
    assert rule.decide(543, lag=0, current=4) == 3


def test_a_burst_inside_the_window_holds_the_count() -> None:
    rule = ScaleRule(POLICY)
    rule.decide(0, lag=300, current=3)
    assert rule.decide(200, lag=0, current=3) == 3
    assert rule.decide(250, lag=250, current=3) == 3  # a recommendation of 3 again
    assert rule.decide(520, lag=0, current=3) == 3  # 250 + 300 has not passed
    assert rule.decide(551, lag=0, current=3) == 2


def test_scaling_up_is_not_held_by_an_earlier_scale_down() -> None:
    rule = ScaleRule(POLICY)
    rule.decide(0, lag=0, current=2)
    assert rule.decide(301, lag=0, current=2) == 1
    assert rule.decide(302, lag=500, current=1) == 3


def test_policy_is_read_from_the_scaled_object() -> None:
    spec = yaml.safe_load(SCALED_OBJECT.read_text())["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    policy = ScalePolicy.from_manifest()
    assert policy.lag_threshold == int(spec["triggers"][0]["metadata"]["lagThreshold"])
    assert (policy.min_workers, policy.max_workers) == (
        spec["minReplicaCount"],
        spec["maxReplicaCount"],
    )
    assert policy.up_pods == behavior["scaleUp"]["policies"][0]["value"]
    assert policy.up_period_s == behavior["scaleUp"]["policies"][0]["periodSeconds"]
    assert policy.down_pods == behavior["scaleDown"]["policies"][0]["value"]
    assert policy.down_period_s == behavior["scaleDown"]["policies"][0]["periodSeconds"]
    assert policy.down_window_s == behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0  # what decide() assumes


def test_faster_divides_every_period_and_keeps_the_counts() -> None:
    fast = POLICY.faster(10)
    assert (fast.up_period_s, fast.down_period_s, fast.down_window_s) == (6, 12, 30)
    assert (fast.lag_threshold, fast.up_pods, fast.down_pods) == (100, 2, 1)
    assert (fast.min_workers, fast.max_workers) == (1, 6)


def test_a_backlog_is_caught_up_once_it_falls_back_under_target() -> None:
    threshold = 300
    assert not caught_up(500, 1, 500, threshold)  # no backlog beyond twice one worker's share
    # Growing: under the target of 3 workers just asked for, but at its peak.
    assert not caught_up(700, 3, 700, threshold)
    assert not caught_up(1000, 3, 4000, threshold)  # falling, still over 3 x 300
    assert caught_up(880, 3, 4000, threshold)
    assert not caught_up(880, 2, 4000, threshold)  # over the target of 2 workers
    assert caught_up(500, 3, 1000, threshold)  # a small peak: down to half of it
    assert not caught_up(600, 3, 1000, threshold)
