"""Exactly-once delivery: a read_committed reader of the reply topic sees each request once.

Workers run with ``--delivery exactly-once``; faults land mid-stream (a SIGKILL
while the worker has a transaction open, its records already on the reply topic);
then every request must have its answer in Redis, and a ``read_committed`` reader
of the reply topic must see each request id exactly once, with the bytes Redis
holds. The ``read_uncommitted`` count of extra records (from transactions the
faults aborted) is printed alongside.
"""

from __future__ import annotations

import pytest

from schemas import topics_for
from tests.faults.conftest import LocalService, Workers, setup, tally, until_answered
from tests.integration.harness import (
    check_exactly_once,
    extra_records_uncommitted,
    kill_inside_a_transaction,
    produce,
    redis_results,
)

EXACTLY_ONCE = ("--delivery", "exactly-once", "--max-batch-size", "8")
FAULTY = "tests.faults.faulty:FaultyDigits"
SLOW = {"CONVEYOR_TEST_SLOW_MS": "20"}  # 8 requests per 20 ms: the faults land mid-stream


@pytest.mark.timeout(300)
async def test_exactly_once_across_worker_sigkills(
    workers: Workers,
    digits: list[tuple[bytes, int]],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
) -> None:
    records, ids = await setup(kafka_bootstrap, model_name, digits, 3000)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    results = topics_for(model_name).results
    first = workers.start(*EXACTLY_ONCE, spec=FAULTY, env=SLOW)
    await until_answered(redis_url, ids, 300)
    left_open = [await kill_inside_a_transaction(first, kafka_bootstrap, results)]
    second = workers.start(*EXACTLY_ONCE, spec=FAULTY, env=SLOW)
    workers.start(*EXACTLY_ONCE, spec=FAULTY, env=SLOW)
    answered = len(await redis_results(redis_url, ids))
    await until_answered(redis_url, ids, answered + 600)
    left_open.append(await kill_inside_a_transaction(second, kafka_bootstrap, results))
    assert len(await redis_results(redis_url, ids)) < len(ids), "the kills must land mid-stream"
    row = await tally(
        "exactly-once: 2 worker SIGKILLs (read_committed)",
        kafka_bootstrap,
        redis_url,
        model_name,
        ids,
        isolation_level="read_committed",
    )
    check_exactly_once(row, workers.logs())
    aborted = await extra_records_uncommitted(kafka_bootstrap, model_name, ids)
    print(
        f"kills left a transaction open: {left_open}; read_uncommitted sees {aborted} extra "
        "reply records from aborted transactions"
    )
    assert any(left_open), "no kill landed inside a transaction: the abort path went untested"


@pytest.mark.timeout(300)
async def test_exactly_once_across_a_broker_restart(
    private_kafka: LocalService,  # first in, last out: the worker stops while it runs
    workers: Workers,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    bootstrap = private_kafka.bootstrap
    records, ids = await setup(bootstrap, model_name, digits, 3000)
    await produce(bootstrap, topics_for(model_name).requests, records[:2000])
    workers.start(*EXACTLY_ONCE, bootstrap=bootstrap)
    await until_answered(redis_url, ids, 300)
    private_kafka.stop()
    private_kafka.start()
    await produce(bootstrap, topics_for(model_name).requests, records[2000:])
    row = await tally(
        "exactly-once: broker stopped and restarted (read_committed)",
        bootstrap,
        redis_url,
        model_name,
        ids,
        180,
        isolation_level="read_committed",
    )
    check_exactly_once(row, workers.logs())
    aborted = await extra_records_uncommitted(bootstrap, model_name, ids)
    print(f"read_uncommitted sees {aborted} extra reply records from aborted transactions")
