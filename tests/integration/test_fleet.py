"""One ``conveyor worker --processes N`` on the CPU: a supervisor and its worker processes.

The real broker and Redis, the supervisor as a real process with real children (no
MPS, no GPU): they serve together behind one ``/readyz`` and one ``/metrics``; a
child killed mid-backlog is started again and nothing is lost; SIGTERM drains every
child; a topic with fewer partitions than processes is a clear exit; a process that
fails at start the same way again and again is no longer started, says why once, and
its partitions go to the others: a model's first process too, whose place another
takes, and one whose model's ``__init__`` raises there alone; a host whose every
process fails at start exits 8.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerProcess, count_results, produce, tally, until
from producers.testing.net import http_get
from schemas import topics_for
from tests.faults import faulty
from tests.harness import digit_requests
from workers.exits import EXIT_CONFIG, EXIT_NO_CARD, EXIT_STOPPED

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def mapped(pid: int) -> str:
    """The files mapped into ``pid``'s memory: its loaded libraries among them."""
    return Path(f"/proc/{pid}/maps").read_text()


async def host_metrics(host: WorkerProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the host's /metrics, by sample name."""
    port = host.metrics_port()
    assert port is not None
    status, body = await http_get(port, "/metrics")
    assert status == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


@pytest.mark.timeout(240)
async def test_one_command_runs_processes_that_serve_behind_one_port_and_drain_together(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start("--processes", "3")
    await host.until_ready(180)  # every process ready: the host's /readyz is 200
    assert len(host.children()) == 3
    assert "fork server ready" in host.log()
    assert all(parent(pid) != host.pid for pid in host.children())  # forked, torch imported
    # The supervisor itself never imports torch: its fork server does, while it starts.
    assert "libtorch" not in mapped(host.pid)

    requests, ids = digit_requests(digits, 600, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=120)
    assert counted.lost == 0, workers.logs()[-3000:]
    assert counted.duplicate_visible == 0

    samples = await host_metrics(host)
    fleet = {labels["state"]: value for labels, value in samples["conveyor_fleet_processes"]}
    assert fleet == {"wanted": 3.0, "running": 3.0, "ready": 3.0}
    answered = [
        (labels["process"], value)
        for labels, value in samples["conveyor_requests_total"]
        if labels["status"] == "ok"
    ]
    assert len({process for process, _ in answered}) == 3  # one series a process
    assert sum(value for _, value in answered) == 600  # the host's total is their sum

    host.signal(signal.SIGTERM)
    assert await host.exited(90) == EXIT_STOPPED
    log = host.log()
    assert log.count("drained and stopping") == 3, log[-3000:]
    assert "second SIGTERM" not in log  # each process got one signal: its drain ran to the end
    assert "every worker process stopped" in log


@pytest.mark.timeout(240)
async def test_a_killed_process_is_started_again_and_nothing_is_lost(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start(
        "--processes", "2", "--max-batch-size", "8", model=faulty.SPEC,
        env={"CONVEYOR_TEST_SLOW_MS": "40"},
    )  # fmt: skip
    await host.until_ready(180)
    first = host.children()
    assert len(first) == 2

    requests, ids = digit_requests(digits, 600, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)

    async def some_answered() -> bool:
        return await count_results(redis_url, ids) >= 60

    await until(some_answered, "a tenth of the backlog answered", 60, host.log, [host])
    victim = first[0]
    os.kill(victim, signal.SIGKILL)  # mid-backlog: its batches in flight go unanswered

    async def replaced() -> bool:
        now = host.children()
        return len(now) == 2 and victim not in now

    await until(replaced, "the killed process is started again", 60, host.log, [host])
    fork_server = parent(first[1])
    assert fork_server != host.pid
    assert all(parent(pid) == fork_server for pid in host.children())  # forked again
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=150)
    assert counted.lost == 0, host.log()[-3000:]
    assert counted.duplicate_visible == 0
    samples = await host_metrics(host)
    [(_, restarts)] = samples["conveyor_fleet_restarts_total"]
    assert restarts == 1.0
    assert "starting it again" in host.log()


@pytest.mark.timeout(120)
async def test_fewer_partitions_than_processes_is_a_clear_exit(
    client_settings: ClientSettings, model_name: str, workers: Fleet
) -> None:
    await create_model_topics(client_settings, model_name, partitions=2)
    host = workers.start("--processes", "3")
    status = await host.exited(60)
    assert status == EXIT_CONFIG
    log = host.log()
    assert f"conveyor.{model_name}.requests has 2 partitions for 3 processes" in log
    assert "Add partitions" in log
    assert "--partitions 3" in log
    assert "loaded its model" not in log  # refused before any process started


@pytest.mark.timeout(240)
async def test_a_process_that_fails_at_start_again_and_again_is_retired_and_others_serve(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start(
        "--processes", "3", "--session-timeout-ms", "6000", model=faulty.SPEC,
        env={"CONVEYOR_TEST_FAIL_AT_START": "-cpu-2"},
    )  # fmt: skip
    requests, ids = digit_requests(digits, 300, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)

    async def retired() -> bool:
        return "It is not started again" in host.log()

    await until(retired, "the failing process is retired", 150, host.log, [host])
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=120)
    assert counted.lost == 0, host.log()[-3000:]  # its partition went to the others
    assert counted.duplicate_visible == 0
    assert len(host.children()) == 2

    log = host.log()
    said = [line for line in log.splitlines() if "failed at start the same way" in line]
    assert len(said) == 1, said  # once
    assert "-cpu-2 failed at start" in said[0]
    assert "RuntimeError: injected: CUDA driver error: invalid argument" in said[0]
    assert "restart the host" in said[0]
    assert log.count("starting it again in") == 2  # three starts in all

    port = host.metrics_port()
    assert port is not None
    status, body = await http_get(port, "/readyz")
    assert status == 503  # serving short of what it should: docs/operations.md
    checks = json.loads(body)["checks"]
    assert checks["processes_ready"] == "ok"
    assert checks["cards"].startswith("not started again after failing at start: ")
    assert checks["cards"].endswith("-cpu-2")
    samples = await host_metrics(host)
    [(_, failed)] = samples["conveyor_fleet_failed_processes"]
    assert failed == 1.0
    cards = {labels["state"]: value for labels, value in samples["conveyor_fleet_cards"]}
    assert cards == {"serving": 1.0, "failed": 0.0}

    host.signal(signal.SIGTERM)
    assert await host.exited(90) == EXIT_STOPPED


async def readyz(host: WorkerProcess) -> tuple[int, dict[str, str]]:
    """The host's /readyz: its status and checks."""
    port = host.metrics_port()
    assert port is not None
    status, body = await http_get(port, "/readyz")
    return status, json.loads(body)["checks"]


@pytest.mark.timeout(240)
async def test_a_host_whose_every_process_fails_at_start_retries_says_why_and_exits_8(
    client_settings: ClientSettings, model_name: str, workers: Fleet
) -> None:
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start(
        "--processes", "3", model=faulty.SPEC,
        env={
            "CONVEYOR_TEST_FAIL_AT_START": "*",  # every process's warm-up forward raises
            "CONVEYOR_TEST_FAIL_AT_START_SAYS": "injected: the warm-up forward failed",
        },
    )  # fmt: skip
    said: dict[str, str] = {}

    async def retrying() -> bool:  # /readyz says why before the host gives up
        if host.metrics_port() is None or "before it loaded" not in host.log():
            return False
        _, checks = await readyz(host)
        said.update(checks)
        return "failed at start 1 time" in checks.get("cards", "")

    await until(retrying, "/readyz names the failed start", 120, host.log, [host])
    assert "RuntimeError: injected: the warm-up forward failed" in said["cards"]
    assert said["processes_ready"] != "ok"
    assert await host.exited(150) == EXIT_NO_CARD
    log = host.log()
    # The first process: three starts (two waits), then its card's next one, once.
    assert log.count("before it loaded") == 2, log[-3000:]
    assert "loads it instead of" in log
    [retired] = [line for line in log.splitlines() if "failed at start the same way" in line]
    assert "-cpu-0 failed at start" in retired  # names count from 0
    assert "(status 1): RuntimeError: injected: the warm-up forward failed" in retired
    [card] = [line for line in log.splitlines() if "the card is given up" in line]
    assert "the CPU: process " in card
    assert "-cpu-1 failed at start as " in card
    assert "the model's 1 other process there not started" in card
    assert "-cpu-2 started" not in log
    assert "no card of this host can serve: stopping the host (exit status 8)" in log


@pytest.mark.timeout(240)
async def test_a_first_process_that_fails_at_start_gives_its_place_and_the_others_serve(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start(
        "--processes", "3", "--session-timeout-ms", "6000", model=faulty.SPEC,
        env={"CONVEYOR_TEST_FAIL_AT_START": "-cpu-0"},  # the first process; its card is fine
    )  # fmt: skip
    requests, ids = digit_requests(digits, 300, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)

    async def serving() -> bool:
        if host.metrics_port() is None:
            return False
        _, checks = await readyz(host)
        return checks.get("processes_ready") == "ok"

    await until(serving, "the other two processes serve", 150, host.log, [host])
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=120)
    assert counted.lost == 0, host.log()[-3000:]
    assert counted.duplicate_visible == 0
    assert len(host.children()) == 2
    log = host.log()
    [said] = [line for line in log.splitlines() if "failed at start the same way" in line]
    assert "-cpu-0 failed at start" in said
    assert "RuntimeError: injected: CUDA driver error: invalid argument" in said
    assert "(status 9)" in said  # a device's error at warm-up: not the model's (status 2)
    assert log.count("before it loaded") == 2  # three starts in all
    assert "-cpu-1 loads it instead of " in log
    status, checks = await readyz(host)
    assert status == 503
    assert checks["cards"] == f"not started again after failing at start: {host_name(log)}-cpu-0"
    samples = await host_metrics(host)
    [(_, failed)] = samples["conveyor_fleet_failed_processes"]
    assert failed == 1.0
    cards = {labels["state"]: value for labels, value in samples["conveyor_fleet_cards"]}
    assert cards == {"serving": 1.0, "failed": 0.0}
    host.signal(signal.SIGTERM)
    assert await host.exited(90) == EXIT_STOPPED


@pytest.mark.timeout(240)
async def test_a_model_whose_init_fails_on_one_process_serves_on_the_others(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    host = workers.start(
        "--processes", "3", "--session-timeout-ms", "6000", model=faulty.SPEC,
        env={"CONVEYOR_TEST_FAIL_INIT": "-cpu-2"},  # not the first: its model loads
    )  # fmt: skip
    requests, ids = digit_requests(digits, 300, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)

    async def retired() -> bool:
        return "It is not started again" in host.log()

    await until(retired, "the failing process is retired", 150, host.log, [host])
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=120)
    assert counted.lost == 0, host.log()[-3000:]  # the host kept serving
    assert counted.duplicate_visible == 0
    assert len(host.children()) == 2
    log = host.log()
    assert "which restarting cannot change" not in log
    [said] = [line for line in log.splitlines() if "failed at start the same way" in line]
    assert "-cpu-2 failed at start" in said
    assert "(status 2)" in said  # the model's own error, but the model loaded elsewhere
    assert "injected: this process cannot create the model" in said
    assert log.count("starting it again in") == 2  # three starts in all
    status, checks = await readyz(host)
    assert status == 503
    assert checks["cards"].endswith("-cpu-2")
    host.signal(signal.SIGTERM)
    assert await host.exited(90) == EXIT_STOPPED


def host_name(log: str) -> str:
    """The processes' common name, ``<host>``, from a host's log (``[<host>-cpu-1] ...``)."""
    found = re.search(r"\[([^\]\s]+)-cpu-1\]", log)
    assert found is not None, log[-2000:]
    return found.group(1)


@pytest.mark.timeout(240)
async def test_sighup_restarts_the_processes_one_at_a_time_and_nothing_is_lost(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    host = workers.start(
        "--processes", "2", "--max-batch-size", "8", model=faulty.SPEC,
        env={"CONVEYOR_TEST_SLOW_MS": "20"},
    )  # fmt: skip
    await host.until_ready(180)
    before = set(host.children())
    requests, ids = digit_requests(digits, 600, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)

    host.signal(signal.SIGHUP)  # mid-backlog

    async def rolled() -> bool:
        return "rolling restart done" in host.log()

    await until(rolled, "the rolling restart is done", 150, host.log, [host])
    after = set(host.children())
    assert len(after) == 2
    assert not before & after  # both processes are new
    log = host.log()
    # One at a time: the second is stopped only once the first's successor serves.
    stops = [n for n, line in enumerate(log.splitlines()) if "SIGTERM: draining" in line]
    assert len(stops) == 2
    first = log.splitlines()[stops[0]].split("]")[0] + "]"  # "[<host>-cpu-<n>]"
    between = log.splitlines()[stops[0] : stops[1]]
    assert any(line.startswith(first) and "ready: serving" in line for line in between)
    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=150)
    assert counted.lost == 0, log[-3000:]
    assert counted.duplicate_visible == 0
    await host.until_ready(30)
