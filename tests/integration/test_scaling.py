"""Horizontal scaling and operations (issue 7), against real workers, Kafka and Redis.

Several workers share a model's partitions and lose nothing when one dies; each
worker's ``/metrics``, ``/readyz`` and ``/healthz`` tell the truth; ``--log-format
json`` logs are machine-readable and tie lines about a request to its id.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from demo.models.digits import build_digits_model, heldout_digits
from schemas import ContentType, Status, consumer_group, encode_request, topics_for
from tests.integration.harness import (
    WorkerProcess,
    assigned_partitions,
    count_results,
    create_model_topics,
    digit_requests,
    free_port,
    http_get,
    produce,
    redis_results,
    until,
    wait_for_results,
)


@pytest.fixture(scope="module")
def digits() -> list[tuple[bytes, int]]:
    build_digits_model()  # the worker processes load the same cached artifact
    return heldout_digits()


class Fleet:
    """The worker processes of one test, each with a metrics port of its own."""

    def __init__(self, model: str, bootstrap: str, redis_url: str, tmp: Path) -> None:
        self.model, self.bootstrap, self.redis_url, self.tmp = model, bootstrap, redis_url, tmp
        self.started: list[tuple[WorkerProcess, int]] = []

    def start(self, *extra: str) -> tuple[WorkerProcess, int]:
        """Start one worker; returns it and its metrics port (listening on 127.0.0.1)."""
        port = free_port()
        worker = WorkerProcess(
            self.model,
            self.bootstrap,
            self.redis_url,
            self.tmp / f"worker-{len(self.started)}.log",
            # Given after the harness's own "--metrics-port 0": the last flag wins.
            ("--metrics-port", str(port), "--metrics-host", "127.0.0.1", *extra),
        )
        self.started.append((worker.start(), port))
        return worker, port

    def logs(self) -> str:
        return "\n".join(w.log() for w, _ in self.started)


@pytest.fixture
def fleet(kafka_bootstrap: str, redis_url: str, model_name: str, tmp_path: Path) -> Iterator[Fleet]:
    group = Fleet(model_name, kafka_bootstrap, redis_url, tmp_path)
    yield group
    for worker, _ in group.started:
        worker.stop()


def _worker_id(worker: WorkerProcess) -> str:
    """The id the worker writes into each result's ``worker`` field (the default one)."""
    assert worker.proc is not None
    return f"{socket.gethostname()}-{worker.proc.pid}"


def _requests_total(exposition: str, model: str) -> dict[str, float]:
    """conveyor_requests_total of ``model``, by status."""
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "conveyor_requests_total" and sample.labels.get("model") == model
    }


@pytest.mark.timeout(180)
async def test_three_workers_share_partitions_and_survive_a_sigkill(
    fleet: Fleet,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(kafka_admin, model_name, partitions=6)
    records = [r for r, _ in digit_requests(digits, 3000, prefix=model_name)]
    ids = [r.key.decode() for r in records]
    topic = topics_for(model_name).requests
    await produce(kafka_bootstrap, topic, records[:600])
    workers = [fleet.start("--max-batch-size", "16")[0] for _ in range(3)]

    def settled() -> bool:
        # Eager rebalancing: each worker's latest assignment is its current one. Only
        # once all three joined do the latest ones split the six partitions exactly.
        now = [assigned_partitions(w.log()) for w in workers]
        if any(not parts for parts in now):
            return False
        owned = [p for parts in now if parts for p in parts]
        return sorted(owned) == list(range(6))

    await until(settled, "every worker gets partitions", 90, fleet.logs)
    await produce(kafka_bootstrap, topic, records[600:1800])  # spread over all six partitions
    worker_ids = {_worker_id(w) for w in workers}

    async def all_answered_some() -> bool:
        results = await redis_results(redis_url, ids[600:1800])
        return worker_ids <= {r.worker for r in results.values()}

    await until(all_answered_some, "every worker answers", 60, fleet.logs)
    workers[0].signal(signal.SIGKILL)
    workers[0].wait()
    # Its share of these can only be answered once its partitions move to the others.
    await produce(kafka_bootstrap, topic, records[1800:])

    results = await wait_for_results(redis_url, ids, timeout=90)
    lost = [i for i in ids if i not in results]
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}\n{fleet.logs()[-5000:]}"
    assert all(r.status is Status.ok for r in results.values())
    answered_after_kill = {results[i].worker for i in ids[1800:]}
    assert answered_after_kill == worker_ids - {_worker_id(workers[0])}


@pytest.mark.timeout(120)
async def test_metrics_count_the_results_written(
    fleet: Fleet,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(kafka_admin, model_name, partitions=3)
    records = [r for r, _ in digit_requests(digits, 200, prefix=model_name)]
    ids = [r.key.decode() for r in records]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker, port = fleet.start()

    results = await wait_for_results(redis_url, ids, timeout=60)
    assert len(results) == len(ids), worker.log()[-5000:]
    assert {r.worker for r in results.values()} == {_worker_id(worker)}
    ok = sum(1 for r in results.values() if r.status is Status.ok)
    # The counters move right after the Redis write (once the reply topic acks too).
    counts: dict[str, float] = {}

    async def counted() -> bool:
        nonlocal counts
        status, body = await http_get(port, "/metrics")
        assert status == 200
        counts = _requests_total(body.decode(), model_name)
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
    fleet: Fleet,
    kafka_admin: AIOKafkaAdminClient,
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
    await create_model_topics(kafka_admin, model_name, partitions=1)
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
        while not holder.assignment():
            await holder.getmany(timeout_ms=100)
        worker, port = fleet.start("--worker-id", f"z-{model_name}")
        probes: list[_Probe] = []

        async def probe() -> bool:
            await holder.getmany(timeout_ms=20)  # keeps the holder's group membership busy
            assert worker.proc is not None
            assert worker.proc.poll() is None, worker.log()
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
    fleet: Fleet,
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(kafka_admin, model_name, partitions=1)
    records = [r for r, _ in digit_requests(digits, 20, prefix=model_name)]
    png = digits[0][0]
    bad_id = f"{model_name}-corrupt"
    bad = encode_request(
        png[: len(png) // 2], request_id=bad_id, content_type=ContentType.PNG, source="tests"
    )
    records.insert(10, bad)
    ids = [r.key.decode() for r in records]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker, _ = fleet.start("--log-format", "json")

    async def answered() -> bool:
        return await count_results(redis_url, ids) == len(ids)

    await until(answered, "every request answered", 60, worker.log)
    assert (await redis_results(redis_url, [bad_id]))[bad_id].status is Status.error
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
