"""Rolling restart of 3 workers, with static group membership and without.

A deploy restarts workers one at a time (SIGTERM, drain, start again) while
requests keep arriving. With ``group_instance_id`` (static membership) the
restarted worker takes its own partitions back and the group never rebalances:
the other workers keep serving, nothing of theirs is revoked or redelivered.
Without it, each stop and each start rebalances the whole group (aiokafka
rebalances eagerly: every member drains and hands back every partition); for
comparison, one restart of that kind is measured (each restart of a rolling
restart repeats it). Both lose nothing.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

import pytest

from producers.testing import Fleet, Tally, WorkerProcess, free_port, until, until_answered
from tests.cluster.conftest import KafkaCluster
from tests.harness import NOTES, check, metrics, setup_model, submit_paced, tally_scenario

PARTITIONS = 6
WORKERS = 3
PACED = "bench.paced:PacedHandler"  # 8 requests per 80 ms batch: 100/s per worker
RATE_CHUNK, RATE_PAUSE_S = 30, 0.2  # about 150 requests/s: busy workers, no runaway backlog
# Longer than a worker takes to stop and start again, so a restart is not mistaken
# for a departure (the trade-off: a worker that never comes back holds its
# partitions idle this long).
STATIC_SESSION_TIMEOUT_MS = 45_000


@dataclass
class Rollout:
    """What one rolling restart did."""

    in_flight: list[int] = field(default_factory=list)  # of each worker as it was stopped
    revoked_elsewhere: int = 0  # revocations in the workers that were not restarting
    same_partitions: list[bool] = field(default_factory=list)


class Slot:
    """One of the three worker positions: a process now, another after its restart."""

    def __init__(self, group: Fleet, name: str, static: bool) -> None:
        self.group, self.name, self.static = group, name, static
        self.process: WorkerProcess | None = None

    def start(self) -> WorkerProcess:
        extra = ["--max-batch-size", "8", "--worker-id", self.name, "--metrics-host", "127.0.0.1"]
        if self.static:
            extra += ["--group-instance-id", self.name]
            extra += ["--session-timeout-ms", str(STATIC_SESSION_TIMEOUT_MS)]
        self.process = self.group.start(*extra, model=PACED, metrics_port=free_port())
        return self.process

    @property
    def worker(self) -> WorkerProcess:
        assert self.process is not None
        return self.process

    @property
    def log(self) -> str:
        return self.worker.log()

    async def in_flight(self) -> int:
        return int((await metrics(self.worker))["conveyor_in_flight_requests"])


async def _roll(
    cluster: KafkaCluster,
    group: Fleet,
    digits: list[tuple[bytes, int]],
    model: str,
    redis_url: str,
    static: bool,
    restarts: int,
) -> tuple[Tally, Rollout]:
    records, ids = await setup_model(
        cluster.bootstrap, model, digits, 20_000, partitions=PARTITIONS, replication_factor=3
    )
    slots = [Slot(group, f"{model}-w{n}", static) for n in range(WORKERS)]
    for slot in slots:
        slot.start()

    def settled() -> bool:
        now = [slot.worker.assigned_partitions() for slot in slots]
        owned = [p for parts in now if parts for p in parts]
        return all(now) and sorted(owned) == list(range(PARTITIONS))

    await until(settled, "every worker gets partitions", 120, group.logs)
    done = asyncio.Event()
    stream = asyncio.create_task(
        submit_paced(
            cluster.bootstrap, model, records, chunk=RATE_CHUNK, pause_s=RATE_PAUSE_S, stop=done
        )
    )
    await until_answered(redis_url, ids, 300)
    rollout = Rollout()
    for slot in slots[:restarts]:
        before = slot.worker.assigned_partitions()
        others = [s for s in slots if s is not slot]
        revoked_before = [s.log.count("partitions revoked:") for s in others]
        rollout.in_flight.append(await slot.in_flight())
        slot.worker.signal(signal.SIGTERM)
        assert await slot.worker.exited(60) == 0
        restarted = slot.start()

        def back(restarted: WorkerProcess = restarted) -> bool:
            return bool(restarted.assigned_partitions())

        await until(back, f"{slot.name} gets partitions again", 120, group.logs)
        await until(settled, "the group settles", 120, group.logs)
        rollout.same_partitions.append(restarted.assigned_partitions() == before)
        rollout.revoked_elsewhere += sum(
            s.log.count("partitions revoked:") - n
            for s, n in zip(others, revoked_before, strict=True)
        )
        assert not stream.done(), "requests must keep arriving during every restart"
    done.set()
    sent = await stream
    kind = "static" if static else "dynamic"
    row = await tally_scenario(
        f"3 workers, {restarts} restarted in turn, {kind} membership",
        cluster.bootstrap,
        redis_url,
        model,
        sent,
        timeout_s=180,
    )
    NOTES.append(
        f"3 workers, {restarts} restarted in turn, {kind} membership: "
        f"{rollout.revoked_elsewhere} revocations in the workers not restarting, "
        f"in-flight at each SIGTERM {rollout.in_flight}, "
        f"same partitions back {rollout.same_partitions}, "
        f"{row.redelivered} redelivered of {row.produced}"
    )
    return row, rollout


@pytest.mark.timeout(400)
async def test_rolling_restart_with_static_membership_keeps_the_group_still(
    healthy_kafka: KafkaCluster,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    row, rollout = await _roll(
        healthy_kafka, cluster_workers, digits, model_name, redis_url, static=True, restarts=3
    )
    check(row, cluster_workers.logs())
    assert rollout.revoked_elsewhere == 0, "no other worker may lose a partition"
    assert all(rollout.same_partitions), rollout
    assert row.redelivered <= sum(rollout.in_flight)


@pytest.mark.timeout(400)
async def test_a_restart_without_static_membership_rebalances_the_group(
    healthy_kafka: KafkaCluster,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    row, rollout = await _roll(
        healthy_kafka, cluster_workers, digits, model_name, redis_url, static=False, restarts=1
    )
    check(row, cluster_workers.logs())
    # What static membership saves: the stop and the start each revoked the partitions
    # of both other workers.
    assert rollout.revoked_elsewhere >= 2 * (WORKERS - 1)
