"""``conveyor`` client commands against the real broker, Redis and a real worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from producers.admin import create_model_topics
from producers.cli import main
from producers.settings import ClientSettings
from producers.testing import Fleet, read_topic
from schemas import (
    DEFAULT_LIMITS,
    encode_result,
    error_result,
    ok_result,
    result_key,
    topics_for,
)
from tests.conftest import REPO


@pytest.fixture
def connection(kafka_bootstrap: str, redis_url: str) -> list[str]:
    return ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]


@pytest.fixture
def stored(redis_url: str, uid: str) -> Iterator[dict[str, str]]:
    """Two results written straight into Redis, as a worker would: an ok one and an error."""
    client = redis.Redis.from_url(redis_url)
    ok_id, error_id = f"{uid}-ok", f"{uid}-err"
    served = ok_result(ok_id, [{"label": "3"}], model="m", model_version="1", worker="t")
    failed = error_result(
        error_id, "decode_failed", "not an image", model="m", model_version="1", worker="t"
    )
    client.set(result_key(ok_id), encode_result(served))
    client.set(result_key(error_id), encode_result(failed))
    yield {"ok": ok_id, "error": error_id}
    client.delete(result_key(ok_id), result_key(error_id))
    client.close()


@pytest.mark.timeout(180)
async def test_submit_wait_prints_one_json_line_per_file(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    tmp_path: Path,
) -> None:
    files = []
    for n, (png, _digit) in enumerate(digits[:3]):
        files.append(tmp_path / f"digit-{n}.png")
        files[-1].write_bytes(png)
    await create_model_topics(client_settings, model_name, partitions=1)
    drop_topics.append(model_name)
    worker = workers.start()
    try:
        # Connection settings from the environment this time, as a deployment would give them.
        env = {
            **os.environ,
            "CONVEYOR_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "CONVEYOR_REDIS_URL": redis_url,
        }
        argv = ["submit", *map(str, files), "--model", model_name, "--wait", "--timeout", "90"]
        done = await _run_cli(argv, env=env)
    finally:
        worker.stop()
    assert done.returncode == 0, done.stderr + worker.log()
    lines = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert sorted(line["file"] for line in lines) == sorted(map(str, files))
    assert all(line["status"] == "ok" and line["model"] == model_name for line in lines)
    assert len({line["id"] for line in lines}) == 3


def test_submit_without_wait_prints_ids(
    connection: list[str],
    digits: list[tuple[bytes, int]],
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No worker needed: the request is only queued. The topic must exist, though."""
    image = tmp_path / "a.png"
    image.write_bytes(digits[0][0])
    drop_topics.append(model_name)
    assert main([*connection, "topics", "create", "--model", model_name, "--partitions", "1"]) == 0
    assert main([*connection, "submit", str(image), "--model", model_name]) == 0
    line = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["file"] == str(image)
    assert len(line["id"]) == 32


async def test_topics_create_makes_three_topics_and_is_idempotent(
    kafka_admin: AIOKafkaAdminClient,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
) -> None:
    argv = ["--kafka-bootstrap", kafka_bootstrap, "topics", "create", "--model", model_name]
    drop_topics.append(model_name)
    first = await _run_cli([*argv, "--partitions", "3"])
    assert first.returncode == 0, first.stderr
    topics = topics_for(model_name)
    size = DEFAULT_LIMITS.max_record_bytes
    assert f"created {topics.requests} (3 partitions, max.message.bytes {size})" in first.stdout
    assert f"created {topics.dlq} (1 partition, max.message.bytes {size})" in first.stdout
    assert "partitions should be >= the largest number of workers planned" in first.stderr
    assert f"new topics take records of up to {size} bytes (max.message.bytes)" in first.stderr
    described = await kafka_admin.describe_topics([topics.requests, topics.results, topics.dlq])
    assert [len(t["partitions"]) for t in described] == [3, 3, 1]

    again = await _run_cli([*argv, "--partitions", "3"])
    assert again.returncode == 0
    assert f"exists  {topics.requests} (3 partitions, max.message.bytes {size})" in again.stdout
    more = await _run_cli([*argv, "--partitions", "6"])
    assert more.returncode == 1
    assert "fewer than the 6 asked for" in more.stderr


async def test_lanes_get_their_own_request_topics_and_submit_picks_one(
    kafka_admin: AIOKafkaAdminClient,
    connection: list[str],
    digits: list[tuple[bytes, int]],
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(digits[0][0])
    drop_topics.append(model_name)
    topics = topics_for(model_name)
    create = ["topics", "create", "--model", model_name, "--partitions", "2", "--lanes", "high"]
    assert await asyncio.to_thread(main, [*connection, *create]) == 0
    assert f"created {topics.lane('high')} (2 partitions," in capsys.readouterr().out
    try:
        submit = ["submit", str(image), "--model", model_name, "--lane", "high"]
        assert await asyncio.to_thread(main, [*connection, *submit]) == 0
        request_id = orjson.loads(capsys.readouterr().out.splitlines()[-1])["id"]
        kafka_bootstrap = connection[1]
        sent = await read_topic(kafka_bootstrap, topics.lane("high"), 1, 30)
        assert [record.key.decode() for record in sent] == [request_id]
        assert await read_topic(kafka_bootstrap, topics.requests, 0, 2) == []
        missing = ["submit", str(image), "--model", model_name, "--lane", "low"]
        assert await asyncio.to_thread(main, [*connection, *missing]) == 2
        assert f"topic {topics.lane('low')} does not exist" in capsys.readouterr().err
    finally:
        await kafka_admin.delete_topics([topics.lane("high")])


async def test_topics_create_flags_an_existing_topic_too_small_for_large_payloads(
    kafka_admin: AIOKafkaAdminClient, kafka_bootstrap: str, model_name: str, drop_topics: list[str]
) -> None:
    topics = topics_for(model_name)
    drop_topics.append(model_name)
    # Made by other tools, with Kafka's default record size limit.
    await kafka_admin.create_topics(
        [NewTopic(topics.requests, 2, 1, topic_configs={"max.message.bytes": "1048588"})]
    )
    argv = ["--kafka-bootstrap", kafka_bootstrap, "topics", "create", "--model", model_name]
    done = await _run_cli([*argv, "--partitions", "2"])
    assert done.returncode == 1
    assert f"exists  {topics.requests} (2 partitions, max.message.bytes 1048588)" in done.stdout
    assert (
        f"--entity-name {topics.requests} --add-config "
        f"max.message.bytes={DEFAULT_LIMITS.max_record_bytes}"
    ) in done.stderr


def test_submit_to_unknown_model_says_how_to_create_it(
    connection: list[str],
    digits: list[tuple[bytes, int]],
    uid: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(digits[0][0])
    assert main([*connection, "submit", str(image), "--model", f"none{uid}"]) == 2
    captured = capsys.readouterr()
    assert f"topic conveyor.none{uid}.requests does not exist" in captured.err
    assert f"conveyor topics create --model none{uid}" in captured.err
    assert captured.out == ""


def test_result_and_wait_print_the_document(
    connection: list[str], stored: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*connection, "result", stored["ok"]]) == 0
    assert orjson.loads(capsys.readouterr().out)["outputs"] == [{"label": "3"}]
    assert main([*connection, "wait", stored["ok"], "--timeout", "5"]) == 0
    assert orjson.loads(capsys.readouterr().out)["id"] == stored["ok"]
    assert main([*connection, "result", stored["error"]]) == 1  # printed, but not ok
    assert orjson.loads(capsys.readouterr().out)["error"]["code"] == "decode_failed"


def test_missing_results_exit_3_naming_the_id(
    connection: list[str], uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = f"{uid}-missing"
    # Without status tracking Redis cannot tell a queued request from an id never sent.
    both = "it may still be queued, or no request with this id was ever sent"
    assert main([*connection, "result", missing]) == 3
    assert f"no result for {missing} yet, and no worker has started it: {both}" in (
        capsys.readouterr().err
    )
    assert main([*connection, "wait", missing, "--timeout", "0.2"]) == 3
    captured = capsys.readouterr()
    assert f"no result for {missing} within 0.2 s, and no worker has started it: {both}" in (
        captured.err
    )
    assert captured.out == ""


def test_an_id_no_tracking_client_sent_is_called_unknown(
    connection: list[str],
    uid: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_TRACK_STATUS", "true")
    never = f"{uid}-never"
    assert main([*connection, "wait", never, "--timeout", "0.2"]) == 3
    assert f"conveyor wait: no request with id {never} is known" in capsys.readouterr().err
    assert main([*connection, "result", never]) == 3
    assert f"no request with id {never} is known" in capsys.readouterr().err
    assert main([*connection, "status", never]) == 0
    captured = capsys.readouterr()
    assert orjson.loads(captured.out) == {"id": never, "state": "unknown"}
    assert f"no request with id {never} is known" in captured.err


async def _run_cli(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``conveyor ARGV`` in a child process (main() cannot run inside the test's event loop)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "producers.cli", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
