"""Shared pytest fixtures.

Integration tests use the real Kafka broker and Redis server that `make up`
starts (ports from KAFKA_PORT and REDIS_PORT). Each test gets its own model
name, topic names and Redis key prefix, so tests never see each other's data.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_trace_globals
from pydantic import SecretStr

from demo.models.digits import build_digits_model, default_model_path, heldout_digits
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerConfig, kafka_admin
from tests.harness import TEST_WORKER_OPTIONS, fault_table, take_records

REPO = Path(__file__).resolve().parents[1]

KAFKA_PORT = int(os.environ.get("KAFKA_PORT", "9092"))
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6379"))
S3_PORT = int(os.environ.get("S3_PORT", "8333"))
# The local store's identity (compose/local/env.sh): test credentials, not secrets.
S3_ACCESS_KEY = os.environ.get("S3_ACCESS_KEY", "conveyor-local")
S3_SECRET_KEY = os.environ.get("S3_SECRET_KEY", "conveyor-local-secret")


def require_listening(service: str, port: int, start: str = "make up") -> None:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError as exc:
        pytest.fail(
            f"{service} is not reachable on 127.0.0.1:{port} ({exc}). "
            f"Run `{start}` first, or run the whole suite with `make test`.",
            pytrace=False,
        )


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n``, each test process's torch gets its share of the cores: with two
    processes each running as many threads as there are cores, the torch-heavy tests of
    both spun against each other (the keypoints served-equals-direct test took 136 s, 11 s
    alone)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        share = (os.cpu_count() or 1) // int(workerinput["workercount"])
        torch.set_num_threads(max(1, share))
    if getattr(config.option, "loadgroup", False):  # set in pytest -n's test processes only
        config.pluginmanager.register(_GroupSuffixes(), "conveyor-group-suffixes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration, tests/faults or tests/cluster needs real services;
    tests/cluster needs the clusters of `make up-cluster` too. Marked before ``-m`` selects
    (pytest's own hook runs after a conftest's), so ``-m cluster`` finds them."""
    for item in items:
        parts = item.path.parts
        if "integration" in parts or "faults" in parts or "cluster" in parts:
            item.add_marker(pytest.mark.integration)
        if "cluster" in parts:
            item.add_marker(pytest.mark.cluster)


class _GroupSuffixes:
    """Under ``--dist loadgroup``, each test of an ``xdist_group`` carries its group in its
    node id, set after pytest-xdist's own hook (which should have set it)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        _suffix_groups(items)


def _suffix_groups(items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` reads a test's group from an ``@<group>`` suffix of the node id
    that a test process reports; pytest-xdist 3.8 writes it to ``Item._nodeid``, which
    pytest 9.2's structured node ids no longer read, so every group was spread over the
    processes as if unmarked (pytest-dev/pytest-xdist#1386). The suffix xdist means is
    set where it is missing (a no-op where xdist's own took effect)."""
    from _pytest.nodeid import NodeId

    for item in items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        suffix = f"@{'_'.join(sorted(names))}"
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


_FAULT_RECORDS = "fault scenarios"  # the name of the user property that carries them
_REPORTED_ROWS: list[str] = []  # every test's rows, as their reports arrive here
_REPORTED_NOTES: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    call: pytest.CallInfo[None],
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test's fault-table rows and notes (tests.harness.tally_scenario) go with its
    teardown report: with ``pytest -n`` the test ran in a worker process, and only its
    reports reach the controller, which prints the table."""
    report: pytest.TestReport = yield
    if call.when == "teardown":
        lines, notes = take_records()
        if lines or notes:
            report.user_properties.append((_FAULT_RECORDS, {"rows": lines, "notes": notes}))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Gathers the fault-table rows and notes that reports carry, in the order they come."""
    for name, value in report.user_properties:
        if name == _FAULT_RECORDS and isinstance(value, dict):
            _REPORTED_ROWS.extend(value["rows"])
            _REPORTED_NOTES.extend(value["notes"])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """The fault table of the scenarios that ran, also in .run/ (by the controller alone
    under ``pytest -n``: a worker has no terminal of its own)."""
    if not _REPORTED_ROWS or hasattr(config, "workerinput"):
        return
    lines = [*fault_table(_REPORTED_ROWS), "", *_REPORTED_NOTES]
    terminalreporter.write_sep("=", "fault scenarios")
    for line in lines:
        terminalreporter.write_line(line)
    report = REPO / ".run" / "fault-report.txt"
    report.parent.mkdir(exist_ok=True)
    report.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    require_listening("Kafka", KAFKA_PORT)
    return f"127.0.0.1:{KAFKA_PORT}"


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_listening("Redis", REDIS_PORT)
    return f"redis://127.0.0.1:{REDIS_PORT}/0"


@pytest.fixture(scope="session")
def s3_options() -> dict[str, str]:
    """S3Settings fields for SeaweedFS's S3 gateway that `make up-s3` starts."""
    require_listening("SeaweedFS's S3 gateway", S3_PORT, "make up-s3")
    return {
        "s3_endpoint_url": f"http://127.0.0.1:{S3_PORT}",
        "s3_access_key_id": S3_ACCESS_KEY,
        "s3_secret_access_key": S3_SECRET_KEY,
        "s3_addressing_style": "path",
    }


@pytest.fixture
async def s3_bucket(s3_options: dict[str, str], uid: str) -> AsyncIterator[str]:
    """A bucket of this test's own, emptied and deleted afterwards."""
    from common.s3 import S3Settings, s3_client

    name = f"t-{uid}"
    async with s3_client(S3Settings.model_validate(s3_options)) as s3:
        await s3.create_bucket(Bucket=name)
        yield name
        listed = await s3.list_objects_v2(Bucket=name)
        for entry in listed.get("Contents", []):
            await s3.delete_object(Bucket=name, Key=entry["Key"])
        await s3.delete_bucket(Bucket=name)


@pytest.fixture
def uid() -> str:
    """A short id unique to this test, for topic names, model names and key prefixes."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def model_name(uid: str) -> str:
    """A model name of this test's own, so its conveyor.<model>.* topics are its own."""
    return f"m{uid}"


@pytest.fixture
def redis_prefix(uid: str) -> str:
    return f"test:{uid}:"


@pytest.fixture
async def redis_client(redis_url: str, redis_prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    keys = [key async for key in client.scan_iter(match=f"{redis_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture(name="kafka_admin")
async def kafka_admin_fixture(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    async with kafka_admin(kafka_bootstrap) as admin:
        yield admin


@pytest.fixture
def client_settings(kafka_bootstrap: str, redis_url: str) -> ClientSettings:
    """The SDK's settings for the services of `make up`."""
    return ClientSettings(kafka_bootstrap=kafka_bootstrap, redis_url=SecretStr(redis_url))


@pytest.fixture
def sdk_spans() -> Iterator[InMemorySpanExporter]:
    """This process's OpenTelemetry SDK, set up as an application sets it up, keeping its
    spans in memory (the SDK's submit spans); the global provider is reset afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another test left a provider set"
    yield exporter
    reset_trace_globals()
    provider.shutdown()


@pytest.fixture(scope="session")
def digits() -> list[tuple[bytes, int]]:
    """The demo model's held-out digits as (PNG, digit); the model is built (cached) first,
    so the worker processes of the tests load it rather than train it. Under ``pytest -n``
    one worker builds it while the others wait on a lock, then find it current."""
    path = default_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        build_digits_model(path)
    return heldout_digits()


@pytest.fixture(scope="session")
def detector() -> Path:
    """The demo detector's weights, trained once per machine (about a minute) and cached;
    under ``pytest -n`` one test process trains while the others wait on a lock."""
    from demo.models.detector import build_detector, default_model_path

    path = default_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        return build_detector(path)


@pytest.fixture
def workers(
    kafka_bootstrap: str, redis_url: str, model_name: str, tmp_path: Path
) -> Iterator[Fleet]:
    """The test's worker processes (``workers.start(*flags, ...)``), stopped at its end."""
    base = WorkerConfig(model_name, kafka_bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    with Fleet(base, tmp_path) as fleet:
        yield fleet


CreateTopic = Callable[..., Awaitable[str]]


@pytest.fixture
async def create_topic(kafka_admin: AIOKafkaAdminClient) -> AsyncIterator[CreateTopic]:
    """Create a topic (deleted again after the test); returns its name."""
    created: list[str] = []

    async def _create(name: str, partitions: int = 3) -> str:
        await kafka_admin.create_topics([NewTopic(name, partitions, 1)])
        created.append(name)
        return name

    yield _create
    if created:
        await kafka_admin.delete_topics(created)


def _built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, built once for the whole run. Under
    ``pytest -n`` each test process's base temporary folder lies in the run's own: there
    the first process to come builds while the others wait on a lock, then find it done
    (the seeded builds would have made the same files in each)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / name, root / f".{name}.built"
    with (root / f".{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a process killed mid-build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def text_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders of tiny text models with a tokenizer trained here (``tests.text_models``),
    by task name."""
    from tests.text_models import save_all

    folder = _built_once(tmp_path_factory, "text-models", save_all)
    return {path.name: path for path in folder.iterdir() if path.is_dir()}


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal LM's folder (tests.generation_model): random weights, a tokenizer
    trained here, saved with ``save_pretrained``; ``hf:FOLDER`` serves it."""
    from tests.generation_model import build_tiny_llm

    return _built_once(tmp_path_factory, "tiny-llm", build_tiny_llm)
