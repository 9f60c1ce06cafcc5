"""Kafka failover on the 3-broker cluster: leaders killed mid-run, every broker restarted in turn.

Topics have three replicas and need two in sync (min.insync.replicas=2). Requests
keep arriving through the SDK's producer during each fault, a worker keeps
publishing through its own, and each scenario asserts lost = 0 and
duplicate-visible = 0 and adds its row (with the redeliveries) to the fault table.
"""

from __future__ import annotations

import asyncio

import pytest

from producers.testing import Fleet, until_answered
from schemas import topics_for
from tests.cluster.conftest import KafkaCluster
from tests.harness import (
    check,
    endless_digit_requests,
    setup_model,
    submit_paced,
    tally_scenario,
)

REPLICAS = 3


@pytest.mark.timeout(300)
async def test_leader_of_requests_then_of_results_killed(
    healthy_kafka: KafkaCluster,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    cluster = healthy_kafka
    topics = topics_for(model_name)
    # Broker 1 leads every request partition, broker 2 every result partition.
    records, ids = await setup_model(
        cluster.bootstrap,
        model_name,
        digits,
        3000,
        replication_factor=REPLICAS,
        leaders={"requests": 1, "results": 2},
    )
    assert await cluster.leaders(topics.requests) == {1}
    assert await cluster.leaders(topics.results) == {2}
    cluster_workers.start("--max-batch-size", "8")

    await submit_paced(cluster.bootstrap, model_name, records[:600])
    await until_answered(redis_url, ids, 300)
    stream = asyncio.create_task(submit_paced(cluster.bootstrap, model_name, records[600:1500]))
    cluster.kill(1)  # mid-stream: the SDK's sends and the worker's fetches lose their leader
    await stream
    assert 1 not in await cluster.leaders(topics.requests)
    await until_answered(redis_url, ids, 1500)

    await asyncio.to_thread(cluster.start, 1)
    await cluster.until_fully_replicated()  # two in sync are needed once broker 2 is gone
    stream = asyncio.create_task(submit_paced(cluster.bootstrap, model_name, records[1500:]))
    await until_answered(redis_url, ids, 1700)
    cluster.kill(2)  # mid-stream: the worker's reply sends lose their leader
    await stream
    assert 2 not in await cluster.leaders(topics.results)

    row = await tally_scenario(
        "Kafka: leader of requests, then of results, killed",
        cluster.bootstrap,
        redis_url,
        model_name,
        ids,
        timeout_s=180,
    )
    check(row, cluster_workers.logs())


@pytest.mark.timeout(300)
async def test_rolling_restart_of_every_broker(
    healthy_kafka: KafkaCluster,
    cluster_workers: Fleet,
    digits: list[tuple[bytes, int]],
    redis_url: str,
    model_name: str,
) -> None:
    cluster = healthy_kafka
    # The first 200 requests of the stream: the same ids (<model>-0 ...) as its own.
    _, first = await setup_model(
        cluster.bootstrap, model_name, digits, 200, replication_factor=REPLICAS
    )
    cluster_workers.start("--max-batch-size", "8")
    done = asyncio.Event()
    # Paced (20 every 0.2 s) and without end until the restarts are done, however long
    # three restarts take on this machine: requests arrive during every one of them.
    endless = endless_digit_requests(digits, model_name)
    stream = asyncio.create_task(
        submit_paced(cluster.bootstrap, model_name, endless, chunk=20, pause_s=0.2, stop=done)
    )
    await until_answered(redis_url, first, 200)
    for node in cluster.nodes:  # as a deploy does it: one broker at a time, in sync between
        if stream.done():  # it ends only on ``done``: this raises what failed it
            await stream
        await asyncio.to_thread(cluster.stop, node)
        await asyncio.to_thread(cluster.start, node)
        await cluster.until_fully_replicated()
    done.set()
    ids = await stream

    row = await tally_scenario(
        "Kafka: rolling restart of all 3 brokers",
        cluster.bootstrap,
        redis_url,
        model_name,
        ids,
        timeout_s=180,
    )
    check(row, cluster_workers.logs())
