"""The autoscaling rule under a load step, on real worker processes (bench.autoscale).

The rule is the one compose/k8s/worker-scaledobject.yaml gives KEDA (workers =
ceil(lag / lagThreshold), scale-up by at most 2 per period, scale-down one at a
time after a stabilization window), with its minutes made seconds. Load steps
from a third of one worker's capacity to twice it and back: the rule must go
1 → 3 → 1 workers, the backlog must fall back under the rule's target while the
load is still high, and every request must be answered once.

The high load lasts until 15 s after the workers caught up with its backlog, at
most 150 s: how soon they do depends on how fast the machine starts a worker
(Python, torch, joining the group), what is checked is that they do while the
load is on, and that the rule adds workers for the backlog and removes them after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.autoscale import COMPRESSED, LOAD_STEP, RunConfig, run
from tests.cluster.conftest import KafkaCluster
from tests.harness import NOTES, check, tally_scenario


@pytest.mark.timeout(500)
async def test_load_step_scales_one_to_three_to_one(
    healthy_kafka: KafkaCluster, redis_url: str, tmp_path: Path
) -> None:
    config = RunConfig(
        bootstrap=healthy_kafka.bootstrap,
        redis_url=redis_url,
        policy=COMPRESSED,
        profile=LOAD_STEP,
        log_dir=tmp_path,
        replication_factor=3,
    )
    report = await run(config)
    logs = _logs(tmp_path)
    samples = report.samples
    high_from, high_until = report.step_ends_s[0], report.step_ends_s[1]
    cap = high_from + LOAD_STEP[1].seconds

    summary = report.summary(high_until)
    path = summary["workers_path"]  # the worker counts, in the order they were held
    peak = path.index(max(path))
    assert (path[0], max(path), path[-1]) == (1, 3, 1), path
    assert path[: peak + 1] == sorted(path[: peak + 1]), f"up, then down: {path}"
    assert path[peak:] == sorted(path[peak:], reverse=True), f"up, then down: {path}"

    # The rule's target: at most lagThreshold waiting per worker, i.e. a backlog the
    # workers serve within target_drain_s. The backlog the step built up must fall
    # back under it while the load is still high, once the new workers serve.
    threshold = config.policy.lag_threshold
    assert summary["peak_lag"] > 2 * threshold, f"no backlog built up: {summary}"
    back = summary["back_under_target_at_s"]
    assert back is not None, f"the backlog never fell back under target: {summary}\n{logs[-3000:]}"
    assert back < high_until, f"back under target only after the load dropped: {summary}"
    # The load ended because the workers caught up, not at its cap.
    assert report.caught_up_at_s is not None, f"not caught up within {cap:g} s: {summary}"
    assert high_until < cap, f"the high load ran to its cap: {summary}"
    assert samples[-1].lag == 0

    row = await tally_scenario(
        "autoscaling 1 → 3 → 1 under a load step",
        healthy_kafka.bootstrap,
        redis_url,
        report.model,
        report.request_ids,
        timeout_s=120,
    )
    check(row, logs)
    NOTES.append(f"autoscaling (load step {high_from:g}-{high_until:g} s): {summary}")


def _logs(folder: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(folder.rglob("*.log")))
