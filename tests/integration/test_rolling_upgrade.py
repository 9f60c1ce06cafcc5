"""A rolling upgrade from v1 to v2 under a steady load, worker by worker, static membership.

Two ways, both on the real broker and Redis: one host's ``conveyor worker --processes 2``
told by SIGHUP to restart its processes in turn, each re-reading the config file the
test rewrote (v1 → v2); and two such hosts restarted one after the other, each with
its own config file changed first. Requests arrive throughout. Afterwards: nothing is
lost; no id's answer in Redis ever changed once there (read again and again while it
ran); every result carries the version that computed it (its output is that
version's); and, per request partition in offset order, the versions switch once,
from v1 to v2.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    WorkerProcess,
    read_results,
    redis_reader,
    until,
    until_answered,
)
from schemas import OutgoingRecord, result_key, topics_for
from tests.harness import NOTES, tally_scenario
from tests.versioned import SPEC, RequestLog, computed_by, switches, versioned_requests

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 4
DRIFTS = {"v1": 0, "v2": 1}
CHUNK, PAUSE_S = 40, 0.1  # a steady stream: 40 requests, a pause, 40 more
# Longer than a process takes to stop and start again: its partitions wait for it rather
# than move (static membership; docs/operations.md "Rolling restarts"). A host is back in
# about 10 s; 30 s leaves room for a busy machine. Not longer: a member learns that another
# joins at its next heartbeat, a third of the session, so the hosts' first joins take up
# to that each (60 s made them take 20 s).
SESSION_TIMEOUT_MS = "30000"


def write_config(path: Path, version: str) -> None:
    """A host's config file: the version (and how it answers) is all that changes."""
    drift = DRIFTS[version]
    path.write_text(f'model_options = {{ version = "{version}", drift = {drift}, slow_ms = 20 }}\n')


def host(workers: Fleet, config: Path, *flags: str) -> WorkerProcess:
    """``conveyor worker --processes 2`` reading ``config``."""
    return workers.start(
        "--processes", "2", "--max-batch-size", "8", "--config-file", str(config),
        "--session-timeout-ms", SESSION_TIMEOUT_MS, *flags, model=SPEC,
    )  # fmt: skip


class Load:
    """Requests sent ``CHUNK`` at a time with a pause between, until stopped; and every
    answer read back from Redis again and again, so that one that changes is seen."""

    def __init__(self, bootstrap: str, redis_url: str, topic: str, prefix: str) -> None:
        self.records, _ = versioned_requests(60_000, prefix)
        self.sent: list[str] = []
        self.changed: list[str] = []
        self._bootstrap, self._redis_url, self._topic = bootstrap, redis_url, topic
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._first = self._last = 0.0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._watch())]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    @property
    def rate(self) -> float:
        """Requests sent per second, on average."""
        return len(self.sent) / (self._last - self._first) if self._last > self._first else 0.0

    async def _send(self) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, acks="all")
        await producer.start()
        self._first = time.monotonic()
        try:
            for begin in range(0, len(self.records), CHUNK):
                if self._stop.is_set():
                    return
                part: Sequence[OutgoingRecord] = self.records[begin : begin + CHUNK]
                acks = [
                    await producer.send(self._topic, r.value, key=r.key, headers=r.headers)
                    for r in part
                ]
                await asyncio.gather(*acks)
                self.sent += [record.key.decode() for record in part]
                self._last = time.monotonic()
                await asyncio.sleep(PAUSE_S)  # the pace of the stream, not a wait for readiness
        finally:
            await producer.stop()
        raise AssertionError("the load ran out of requests before the test stopped it")

    async def _watch(self) -> None:
        first: dict[str, bytes] = {}
        async with redis_reader(self._redis_url) as client:
            while not self._stop.is_set():
                ids = list(self.sent)
                for start in range(0, len(ids), 2000):
                    chunk = ids[start : start + 2000]
                    values = await client.mget([result_key(i) for i in chunk])
                    for request_id, value in zip(chunk, values, strict=True):
                        if value is None:
                            continue
                        stored = value.encode() if isinstance(value, str) else value
                        seen = first.setdefault(request_id, stored)
                        if seen != stored:
                            self.changed.append(request_id)
                await asyncio.sleep(0.2)  # the next look, not a wait for readiness


async def check_upgrade(load: Load, bootstrap: str, redis_url: str, model: str, what: str) -> None:
    """Every request answered once, by the version that computed it, v1 then v2 per
    partition; no answer changed."""
    topics = topics_for(model)
    ids = load.sent
    counted = await tally_scenario(f"rolling upgrade: {what}", bootstrap, redis_url, model, ids)
    assert counted.lost == 0
    assert counted.duplicate_visible == 0
    assert load.changed == []
    results = await read_results(redis_url, ids)
    payloads = {r.key.decode(): r.value for r in load.records[: len(ids)]}
    assert all(computed_by(results[i], payloads[i], DRIFTS) for i in ids)
    log = await RequestLog.read(bootstrap, topics.requests, len(ids))
    orders = log.in_offset_order({i: results[i].model_version for i in ids})
    assert len(orders) == PARTITIONS
    for partition, versions in orders.items():
        assert versions[0] == "v1", partition
        assert versions[-1] == "v2", partition
        assert switches(versions) == 1, (partition, versions)
    by_version = {v: sum(r.model_version == v for r in results.values()) for v in DRIFTS}
    NOTES.append(
        f"rolling upgrade, {what}: {len(ids)} requests at {load.rate:.0f}/s, "
        f"{by_version['v1']} answered by v1 and {by_version['v2']} by v2, one switch per "
        f"partition, {counted.redelivered} redelivered, changed {len(load.changed)}"
    )


@pytest.mark.timeout(300)
async def test_sighup_upgrades_a_host_process_by_process_under_load(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    drop_topics: list[str],
    tmp_path: Path,
) -> None:
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=PARTITIONS)
    config = tmp_path / "worker.toml"
    write_config(config, "v1")
    one = host(workers, config)
    await one.until_ready(180)
    load = Load(kafka_bootstrap, redis_url, topics_for(model_name).requests, model_name)
    load.start()
    try:
        await until(lambda: len(load.sent) >= 1000, "1,000 requests sent", 60)
        await until_answered(redis_url, list(load.sent), 500)
        write_config(config, "v2")
        one.signal(signal.SIGHUP)

        def rolled() -> bool:
            return "rolling restart done" in one.log()

        await until(rolled, "the rolling restart is done", 180, one.log, [one])
        sent = len(load.sent)
        await until(lambda: len(load.sent) >= sent + 1000, "1,000 more requests sent", 60)
    finally:
        await load.stop()
    await check_upgrade(load, kafka_bootstrap, redis_url, model_name, "one host, SIGHUP")


@pytest.mark.timeout(400)
async def test_hosts_upgraded_one_after_the_other_under_load(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    drop_topics: list[str],
    tmp_path: Path,
) -> None:
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=PARTITIONS)
    names = ("host-a", "host-b")
    configs = {name: tmp_path / f"{name}.toml" for name in names}
    running = {}
    for name in names:
        write_config(configs[name], "v1")
        running[name] = host(
            workers, configs[name], "--group-instance-id", name, "--worker-id", name
        )
    for name in names:
        await running[name].until_ready(180)
    load = Load(kafka_bootstrap, redis_url, topics_for(model_name).requests, model_name)
    load.start()
    try:
        await until(lambda: len(load.sent) >= 1000, "1,000 requests sent", 60)
        await until_answered(redis_url, list(load.sent), 500)
        for name in names:  # the operator's loop: new config, restart, wait until ready
            write_config(configs[name], "v2")
            running[name].signal(signal.SIGTERM)
            assert await running[name].exited(90) == 0
            running[name] = host(
                workers, configs[name], "--group-instance-id", name, "--worker-id", name
            )
            await running[name].until_ready(180)
        sent = len(load.sent)
        await until(lambda: len(load.sent) >= sent + 1000, "1,000 more requests sent", 60)
    finally:
        await load.stop()
    await check_upgrade(load, kafka_bootstrap, redis_url, model_name, "two hosts in turn")
