"""Exactly-once delivery on the 3-broker cluster: a worker killed mid-transaction, a broker killed.

Topics and Kafka's transaction log have three replicas, two in sync required. A
worker in exactly-once delivery is killed while it has a transaction open, two
others take over, and then the broker leading every result partition is killed
(SIGKILL) while they write. A ``read_committed`` reader of the reply topic must
see each request once, with the bytes Redis holds.
"""

from __future__ import annotations

import pytest

from producers.testing import Fleet, produce, read_results, until_answered
from schemas import topics_for
from tests.cluster.conftest import KafkaCluster
from tests.faults import faulty
from tests.harness import (
    check_exactly_once,
    extra_records_uncommitted,
    kill_inside_a_transaction,
    setup_model,
    tally_scenario,
)

EXACTLY_ONCE = ("--delivery", "exactly-once", "--max-batch-size", "8")
SLOW = {"CONVEYOR_TEST_SLOW_MS": "20"}  # 8 requests per 20 ms: the faults land mid-stream


@pytest.mark.timeout(300)
async def test_exactly_once_across_a_worker_kill_and_a_broker_kill(
    healthy_kafka: KafkaCluster,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    cluster = healthy_kafka
    topics = topics_for(model_name)
    records, ids = await setup_model(
        cluster.bootstrap,
        model_name,
        digits,
        3000,
        replication_factor=3,
        leaders={"requests": 1, "results": 2},
    )
    await produce(cluster.bootstrap, topics.requests, records)
    first = cluster_workers.start(*EXACTLY_ONCE, model=faulty.SPEC, env=SLOW)
    await until_answered(redis_url, ids, 300)
    left_open = await kill_inside_a_transaction(first, cluster.bootstrap, topics.results)
    cluster_workers.start(*EXACTLY_ONCE, model=faulty.SPEC, env=SLOW)
    cluster_workers.start(*EXACTLY_ONCE, model=faulty.SPEC, env=SLOW)
    answered = len(await read_results(redis_url, ids))
    await until_answered(redis_url, ids, answered + 300)
    cluster.kill(2)  # the leader of every result partition, mid-transaction
    assert len(await read_results(redis_url, ids)) < len(ids), "the kills must land mid-stream"

    row = await tally_scenario(
        "exactly-once, 3 brokers: worker and results leader killed (read_committed)",
        cluster.bootstrap,
        redis_url,
        model_name,
        ids,
        timeout_s=180,
        isolation_level="read_committed",
    )
    check_exactly_once(row, cluster_workers.logs())
    aborted = await extra_records_uncommitted(cluster.bootstrap, model_name, ids)
    print(
        f"the worker kill left a transaction open: {left_open}; read_uncommitted sees "
        f"{aborted} extra reply records from aborted transactions"
    )
    assert left_open, "the worker kill did not land inside a transaction"
