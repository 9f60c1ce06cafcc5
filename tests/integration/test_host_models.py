"""One ``conveyor worker --config-file host.toml`` serving several models (``[[models]]``).

The real broker and Redis, the supervisor as a real process with one CPU process a
model: each model answers its own requests; a model that cannot load does not stop the
others and ``/readyz`` names it; SIGHUP after the file changed starts the model added,
drains the model removed, and leaves the others' processes alone (same pids, no new
partition assignment) while their requests flow, nothing lost, no answer changed.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerProcess, produce, read_results, tally, until
from producers.testing.net import http_get
from schemas import topics_for
from tests.harness import digit_requests
from workers.cli import main
from workers.exits import EXIT_STOPPED

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def host_file(path: Path, models: dict[str, dict[str, str]]) -> Path:
    """``path`` written as a host file: one ``[[models]]`` table each."""
    tables = []
    for name, keys in models.items():
        lines = [f'model_name = "{name}"', *(f'{k} = "{v}"' for k, v in keys.items())]
        tables.append("[[models]]\n" + "\n".join(lines))
    path.write_text("max_batch_size = 8\n\n" + "\n\n".join(tables) + "\n")
    return path


async def model_ready(host: WorkerProcess, name: str) -> dict[str, object]:
    port = host.metrics_port()
    if port is None:
        return {"ready": False}
    status, body = await http_get(port, f"/readyz?model={name}")
    answer: dict[str, object] = json.loads(body) if status in (200, 503) else {"ready": False}
    return answer


def processes(log: str) -> dict[int, str]:
    """The model of each process the host started, by pid (from the supervisor's log:
    a forked process's command line is its fork server's)."""
    started = re.findall(r"process \S+-(m\w+)-cpu-\d+ started: pid (\d+)", log)
    return {int(pid): model for model, pid in started}


def assignments(log: str, process: str) -> int:
    return sum(
        1 for line in log.splitlines() if line.startswith(f"[{process}]") and "assigned" in line
    )


@pytest.mark.timeout(420)
async def test_one_command_serves_several_models_and_reloads_what_changed(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    detector: Path,
    tmp_path: Path,
) -> None:
    classifier, boxes, embedder = f"{model_name}c", f"{model_name}d", f"{model_name}e"
    added, broken = f"{model_name}a", f"{model_name}b"
    names = [classifier, boxes, embedder, added, broken]
    for name in names:
        await create_model_topics(client_settings, name, partitions=1)
    models = {
        classifier: {"model": "digits"},
        boxes: {"model": "demo.models.detector:DigitsDetector", "weights": str(detector)},
        embedder: {"model": "embedding:mobilenet_v3_small", "weights": "random"},
        broken: {"model": "embedding:mobilenet_v3_small", "weights": str(tmp_path / "no.pt")},
    }
    path = host_file(tmp_path / "host.toml", models)
    try:
        host = workers.start("--config-file", str(path), model="")

        async def serving() -> bool:
            ready = [await model_ready(host, n) for n in (classifier, boxes, embedder)]
            return all(r.get("ready") for r in ready)

        await until(serving, "the three models are ready", 240, host.log, [host])

        async def named() -> bool:  # the model that cannot load, once its process exited
            status, body = await http_get(host.metrics_port() or 0, "/readyz")
            return status == 503 and f"model {broken}" in json.loads(body)["checks"]["models"]

        await until(named, f"/readyz names {broken}", 60, host.log, [host])
        assert (await model_ready(host, broken))["ready"] is False
        assert f"model {broken} cannot serve, the host's other models serve on" in host.log()
        status, body = await http_get(host.metrics_port() or 0, "/metrics")
        assert status == 200
        samples = {
            (s.name, s.labels.get("model"), s.labels.get("state")): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
            if s.name.startswith("conveyor_fleet_")
        }
        for name in (classifier, boxes, embedder):
            assert samples[("conveyor_fleet_processes", name, "ready")] == 1.0
        assert samples[("conveyor_fleet_failed_processes", broken, None)] == 1.0
        assert samples[("conveyor_fleet_ready", "host", None)] == 0.0

        # Each model answers its own requests, before and across the reload.
        sent: dict[str, list[str]] = {}
        for name in (classifier, boxes, embedder):
            records, ids = digit_requests(digits, 40, prefix=f"{name}-before")
            await produce(kafka_bootstrap, topics_for(name).requests, records)
            sent[name] = ids
        for name in (classifier, boxes, embedder):
            counted = await tally(kafka_bootstrap, redis_url, topics_for(name).results, sent[name])
            assert counted.lost == 0, host.log()[-3000:]
        answered = await read_results(redis_url, sent[classifier] + sent[embedder])
        assert {r.model for r in answered.values()} == {classifier, embedder}

        pids = {processes(host.log())[pid]: pid for pid in host.children()}
        assert set(pids) == {classifier, boxes, embedder}
        hostname = socket.gethostname()
        untouched = [f"{hostname}-{n}-cpu-0" for n in (classifier, embedder)]
        assigned = {p: assignments(host.log(), p) for p in untouched}
        assert all(assigned.values()), host.log()[-3000:]

        # The detector leaves, a second digits model comes; requests flow meanwhile.
        del models[boxes]
        models[added] = {"model": "digits"}
        host_file(path, models)
        flowing = asyncio.create_task(_flow(kafka_bootstrap, digits, [classifier, embedder]))
        host.signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return "host file reloaded" in host.log()

        await until(reloaded, "the host file is reloaded", 180, host.log, [host])
        during = await flowing
        await until(_ready_of(host, added), f"{added} is ready", 120, host.log, [host])
        log = host.log()
        # The model left out is tried again (and fails again): its file may be fixed.
        assert f"start {added}, {broken}; drain and stop {boxes}; leave alone" in log
        assert log.count(f"model {broken} cannot serve") == 2
        after = {processes(log)[pid]: pid for pid in host.children()}
        assert set(after) == {classifier, embedder, added}
        assert after[classifier] == pids[classifier]
        assert after[embedder] == pids[embedder]
        assert {p: assignments(log, p) for p in untouched} == assigned  # no rebalance

        records, ids = digit_requests(digits, 40, prefix=f"{added}-after")
        await produce(kafka_bootstrap, topics_for(added).requests, records)
        counted = await tally(kafka_bootstrap, redis_url, topics_for(added).results, ids)
        assert counted.lost == 0, log[-3000:]
        for name, ids in during.items():
            counted = await tally(kafka_bootstrap, redis_url, topics_for(name).results, ids)
            assert counted.lost == 0, log[-3000:]
            assert counted.duplicate_visible == 0
        assert await read_results(redis_url, list(answered)) == answered  # none changed

        host.signal(signal.SIGTERM)
        assert await host.exited(90) == EXIT_STOPPED
    finally:
        for name in names:
            await delete_model_topics(client_settings, name)


def _ready_of(host: WorkerProcess, name: str) -> Callable[[], Awaitable[bool]]:
    async def ready() -> bool:
        return bool((await model_ready(host, name)).get("ready"))

    return ready


async def _flow(
    bootstrap: str, digits: list[tuple[bytes, int]], names: list[str]
) -> dict[str, list[str]]:
    """Requests to ``names`` in small bursts for a few seconds: their ids by model."""
    sent: dict[str, list[str]] = {name: [] for name in names}
    for burst in range(10):
        for name in names:
            records, ids = digit_requests(digits, 10, prefix=f"{name}-during{burst}")
            await produce(bootstrap, topics_for(name).requests, records)
            sent[name] += ids
        await asyncio.sleep(0.5)
    return sent


@pytest.mark.timeout(300)
async def test_a_changed_process_count_applies_on_sighup(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model whose count changes is drained and started anew with the new count, its
    requests answered across it (``--check`` says so first, asking the running host); a
    count its topic cannot serve changes nothing."""
    name = f"{model_name}n"
    await create_model_topics(client_settings, name, partitions=2)
    models = {name: {"model": "digits", "processes": "1"}}
    path = host_file(tmp_path / "host.toml", models)
    try:
        host = workers.start("--config-file", str(path), model="")
        await until(_ready_of(host, name), f"{name} is ready", 120, host.log, [host])
        [before] = host.children()

        models[name]["processes"] = "2"
        host_file(path, models)
        check = ["--config-file", str(path), "--check", "--metrics-port", str(host.metrics_port())]
        assert main(check) == 0  # what a SIGHUP would do, asked of the running host
        assert (
            f"would: drain, then start with the new process count or cards {name}"
            in capsys.readouterr().out
        )
        flowing = asyncio.create_task(_flow(kafka_bootstrap, digits, [name]))
        host.signal(signal.SIGHUP)

        async def two() -> bool:
            return len(host.children()) == 2 and await _ready_of(host, name)()

        await until(two, f"two processes of {name} ready", 120, host.log, [host])
        assert before not in host.children()
        assert f"model {name}: 1 processes become 2" in host.log()
        during = await flowing
        counted = await tally(kafka_bootstrap, redis_url, topics_for(name).results, during[name])
        assert counted.lost == 0, host.log()[-3000:]

        models[name]["processes"] = "3"  # the topic has 2 partitions
        host_file(path, models)
        serving = set(host.children())
        host.signal(signal.SIGHUP)

        async def refused() -> bool:
            return f"SIGHUP: model {name} keeps its 2 processes" in host.log()

        await until(refused, "the count refused", 60, host.log, [host])
        await until(
            lambda: "host file reloaded" in host.log().split("keeps its 2")[-1],
            "the reload is done",
            60,
            host.log,
            [host],
        )
        assert set(host.children()) == serving
        host.signal(signal.SIGTERM)
        assert await host.exited(90) == EXIT_STOPPED
    finally:
        await delete_model_topics(client_settings, name)
