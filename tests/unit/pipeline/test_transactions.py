"""Exactly-once delivery: each partition's answers committed in order in transactions
with its position, a lost transaction read again, a revoked partition closed after
its drain, and never two transactions at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from producers.testing import until
from schemas.canary import canary_marker
from tests.fakes import TOPIC, FakeRecord, FakeSource, FakeTransactions, GatedEcho
from tests.unit.pipeline.harness import make, records, revoke_in_flight, run_until
from workers.observe.metrics import Metrics
from workers.types import Committed, Outbox, PartitionCommit


def check_exactly_once(txns: FakeTransactions, partitions: dict[int, int]) -> None:
    """Every request committed once, and each transaction covers exactly the records
    between its partition's previous position and its own."""
    ids = txns.ids()
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(
        f"p{p}-{n}" for p, count in partitions.items() for n in range(count)
    )
    position = dict.fromkeys(partitions, 0)
    for part in txns.committed:
        p = part.partition[1]
        offsets = sorted(int(i.split("-")[1]) for i in part.outbox.ids)
        assert offsets == list(range(position[p], part.position))
        position[p] = part.position
    assert position == partitions


async def test_exactly_once_commits_each_partition_in_order_with_its_position() -> None:
    bad = records(0, 30)
    r = bad[3]  # a refusal, answered long before the records around it
    bad[3] = FakeRecord(
        r.topic, 0, r.offset, 0, r.key, r.value, [h for h in r.headers if h[0] != "ce_source"]
    )
    source = FakeSource({0: bad, 1: records(1, 30)})
    txns = FakeTransactions(source)
    metrics = Metrics("t")
    pipeline, sink = make(source, GatedEcho(), metrics=metrics, transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 60)
    check_exactly_once(txns, {0: 30, 1: 30})
    assert sink.outboxes == []  # nothing went the at-least-once way
    dead = [letter for part in txns.committed for letter in part.outbox.dead]
    assert len(dead) == 1 + 1  # the bad request and the poison item, inside transactions
    assert metrics.totals().answered == 60


async def test_a_lost_transaction_reads_its_partition_again_from_the_committed_position() -> None:
    source = FakeSource({0: records(0, 40, first=0), 1: records(1, 40)})
    txns = FakeTransactions(source, lose={(TOPIC, 0)})
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 80)
    assert source.restarted == [(TOPIC, 0)]
    check_exactly_once(txns, {0: 40, 1: 40})


async def test_exactly_once_revoke_closes_the_partition_after_its_drain() -> None:
    source = FakeSource({0: records(0, 24), 1: records(1, 24)})
    txns = FakeTransactions(source)
    model = GatedEcho()
    model.gate = threading.Event()  # what was fetched is in flight when the revocation comes
    pipeline, _ = make(source, model, transactions=txns)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        fetched = await revoke_in_flight(source, model, 1)
        assert txns.closed == [(TOPIC, 1)]
        assert source.committed[1] == fetched  # drained and committed in transactions
        await until(lambda: source.committed.get(0) == 24, "partition 0 committed", 5)
    finally:
        model.gate.set()
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_exactly_once_transactions_never_overlap() -> None:
    source = FakeSource({p: records(p, 30) for p in range(3)})

    @dataclass
    class Counted(FakeTransactions):
        in_progress: int = 0
        most: int = 0

        async def publish(self, parts: Sequence[PartitionCommit]) -> tuple[list[Committed], int]:
            self.in_progress += 1
            self.most = max(self.most, self.in_progress)
            try:
                await asyncio.sleep(0.005)
                return await super().publish(parts)
            finally:
                self.in_progress -= 1

    txns = Counted(source)
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    await run_until(pipeline, lambda: len(txns.ids()) == 90)
    check_exactly_once(txns, dict.fromkeys(range(3), 30))
    assert txns.most == 1


async def test_records_skipped_after_the_last_answer_are_committed_past_once_idle() -> None:
    """A canary marker at 100% and the canary's requests after a partition's last answer
    of the primary: no transaction of answers carries their position, so the idle worker
    commits it in a transaction of its own (otherwise the group shows lag for ever)."""
    answered = records(0, 20)
    source = FakeSource({0: answered})
    txns = FakeTransactions(source)
    pipeline, _ = make(source, GatedEcho(), transactions=txns)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        await until(lambda: source.committed.get(0) == 20, "the answers committed", 10)
        marker = canary_marker(1.0, "t")
        answered.append(FakeRecord(TOPIC, 0, 20, 0, marker.key, marker.value, marker.headers))
        answered += records(0, 10, first=21)  # the canary's: its share is 100%
        await until(lambda: source.committed.get(0) == 31, "committed past the skipped", 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert txns.committed[-1] == PartitionCommit((TOPIC, 0), Outbox(), 31)  # the position alone
    assert len(txns.ids()) == 20  # the canary's requests were left to its group
