"""Horizontal scaling and operations (issue 7), against real workers, Kafka and Redis.

Several workers share a model's partitions and lose nothing when one dies; each
worker's ``/metrics``, ``/readyz`` and ``/healthz`` tell the truth; ``--log-format
json`` logs are machine-readable and tie lines about a request to its id.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

import pytest
from aiokafka import AIOKafkaConsumer

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    WorkerProcess,
    count_results,
    free_port,
    http_get,
    produce,
    read_results,
    until,
    wait_for_results,
)
from schemas import ContentType, Status, consumer_group, encode_request, topics_for
from tests.harness import digit_requests, requests_by_status


def _start(fleet: Fleet, *flags: str) -> tuple[WorkerProcess, int]:
    """Start one worker with a metrics port of its own (on 127.0.0.1); it and its port."""
    worker = fleet.start("--metrics-host", "127.0.0.1", *flags, metrics_port=free_port())
    port = worker.metrics_port()
    assert port is not None
    return worker, port


@pytest.mark.timeout(180)
async def test_three_workers_share_partitions_and_survive_a_sigkill(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=6)
    records, ids = digit_requests(digits, 3000, prefix=model_name)
    topic = topics_for(model_name).requests
    await produce(kafka_bootstrap, topic, records[:600])
    three = [workers.start("--max-batch-size", "16") for _ in range(3)]

    def settled() -> bool:
        # Eager rebalancing: each worker's latest assignment is its current one. Only
        # once all three joined do the latest ones split the six partitions exactly.
        now = [w.assigned_partitions() for w in three]
        if any(not parts for parts in now):
            return False
        owned = [p for parts in now if parts for p in parts]
        return sorted(owned) == list(range(6))

    await until(settled, "every worker gets partitions", 90, workers.logs)
    await produce(kafka_bootstrap, topic, records[600:1800])  # spread over all six partitions
    worker_ids = {w.default_id for w in three}

    async def all_answered_some() -> bool:
        results = await read_results(redis_url, ids[600:1800])
        return worker_ids <= {r.worker for r in results.values()}

    await until(all_answered_some, "every worker answers", 60, workers.logs)
    three[0].kill()
    # Its share of these can only be answered once its partitions move to the others.
    await produce(kafka_bootstrap, topic, records[1800:])

    results = await wait_for_results(redis_url, ids, timeout_s=90)
    lost = [i for i in ids if i not in results]
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}\n{workers.logs()[-5000:]}"
    assert all(r.status is Status.ok for r in results.values())
    answered_after_kill = {results[i].worker for i in ids[1800:]}
    assert answered_after_kill == worker_ids - {three[0].default_id}


@pytest.mark.timeout(120)
async def test_metrics_count_the_results_written(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=3)
    records, ids = digit_requests(digits, 200, prefix=model_name)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker, port = _start(workers)

    results = await wait_for_results(redis_url, ids, timeout_s=60)
    assert len(results) == len(ids), worker.log()[-5000:]
    assert {r.worker for r in results.values()} == {worker.default_id}
    ok = sum(1 for r in results.values() if r.status is Status.ok)
    # The counters move right after the Redis write (once the reply topic acks too).
    counts: dict[str, float] = {}

    async def counted() -> bool:
        nonlocal counts
        status, body = await http_get(port, "/metrics")
        assert status == 200
        counts = requests_by_status(body.decode(), model_name)
        return counts.get("ok") == ok

    await until(
        counted, f"conveyor_requests_total ok={ok}", 10, lambda: f"last: {counts}\n{worker.log()}"
    )
    assert sum(counts.values()) == len(ids)  # and nothing counted under another status


@dataclass(frozen=True)
class _Probe:
    status: int
    checks: dict[str, str]


@pytest.mark.timeout(120)
async def test_readyz_503_until_serving_then_200(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    model_name: str,
) -> None:
    # Deterministic "not ready yet": a consumer of the test's own holds the only
    # partition of the worker's group. The default round-robin assignor hands
    # partitions out in member-id order, and a member id starts with the client id,
    # so "0-holder" keeps the partition while the worker ("z-...") is in the group:
    # the worker loads and warms its model, joins, and must still answer 503 (no
    # partitions) until the holder leaves. Polling from the moment the port opens
    # may also catch the model still loading; either way the first answers are 503.
    await create_model_topics(client_settings, model_name, partitions=1)
    holder = AIOKafkaConsumer(
        topics_for(model_name).requests,
        bootstrap_servers=kafka_bootstrap,
        group_id=consumer_group(model_name),
        client_id="0-holder",
        enable_auto_commit=False,
        session_timeout_ms=6000,
    )
    await holder.start()
    try:

        async def holds_it() -> bool:
            await holder.getmany(timeout_ms=100)  # the holder joins its group while it fetches
            return bool(holder.assignment())

        await until(holds_it, "the holder owns the partition", 30)
        worker, port = _start(workers, "--worker-id", f"z-{model_name}")
        probes: list[_Probe] = []

        async def probe() -> bool:
            await holder.getmany(timeout_ms=20)  # keeps the holder's group membership busy
            assert worker.running(), worker.log()
            try:
                status, body = await http_get(port, "/readyz")
            except OSError:
                return False  # not listening yet
            probes.append(_Probe(status, json.loads(body)["checks"]))
            joined = "partitions assigned: none" in worker.log()
            return joined and probes[-1].checks["model_loaded"] == "ok"

        await until(probe, "the worker loads its model and joins", 60, worker.log)
        assert holder.assignment(), "the holder must still own the partition"
        assert all(p.status == 503 for p in probes), probes
        assert probes[-1].checks["partitions_assigned"] == "failed", probes[-1]
        assert (await http_get(port, "/healthz"))[0] == 200  # alive, merely not ready
    finally:
        await holder.stop()  # leaves the group: the partition moves to the worker

    async def ready() -> bool:
        status, body = await http_get(port, "/readyz")
        probes.append(_Probe(status, json.loads(body)["checks"]))
        return status == 200

    await until(ready, "/readyz turns 200 once the worker owns a partition", 30, worker.log)
    assert set(probes[-1].checks.values()) == {"ok"}
    assert (await http_get(port, "/healthz"))[0] == 200


@pytest.mark.timeout(120)
async def test_json_logs_parse_and_carry_request_ids(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=1)
    records, _ = digit_requests(digits, 20, prefix=model_name)
    png = digits[0][0]
    bad_id = f"{model_name}-corrupt"
    bad = encode_request(
        png[: len(png) // 2], request_id=bad_id, content_type=ContentType.PNG, source="tests"
    )
    records.insert(10, bad)
    ids = [r.key.decode() for r in records]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker = workers.start("--log-format", "json")

    async def answered() -> bool:
        return await count_results(redis_url, ids) == len(ids)

    await until(answered, "every request answered", 60, worker.log)
    assert (await read_results(redis_url, [bad_id]))[bad_id].status is Status.error
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0  # the drain's lines are in the log too

    lines = [json.loads(line) for line in worker.log().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "message"} <= doc.keys() for doc in lines)
    # Lines about a request carry its id as a field, not only inside the message.
    about = [doc for doc in lines if any(i in doc["message"] for i in ids)]
    assert all(str(doc.get("request_id")) in doc["message"] for doc in about), about
    tagged = [doc for doc in lines if doc.get("request_id") == bad_id]
    assert tagged, "no log line carries the failed request's request_id"
    assert tagged[0]["level"] in ("WARNING", "ERROR")
