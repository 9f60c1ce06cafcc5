"""Kafka authorization: a worker whose principal lacks one of the ACLs docs/security.md
lists stops with status 3 and a line naming the missing ACL, having committed nothing.

The broker is the SASL_SSL one of ``compose/local/secure.sh`` with ``SECURE_ACLS=1``
(KRaft's StandardAuthorizer, nothing allowed without an ACL), started once for this
module. Workers log in as its limited user, whose ACLs (added with
``compose/local/kafka-acls.sh``) are the documented ones less one; the tests set up,
produce, read and check through the broker's loopback listener, whose principal is a
super user. After each refusal a worker of the super user answers every request:
nothing was lost. A worker stuck on a refused write stops within its drain bound on
SIGTERM (SIGINT, which reaches the same handler, is tried in test_redis_acl.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerProcess, free_port, free_ports, kafka_admin, produce
from producers.testing import until as until_true
from schemas import ContentType, consumer_group, encode_request, topics_for
from tests.conftest import REPO
from tests.harness import NOTES, check, digit_requests, logged_at, tally_scenario
from workers.app import CLOSE_S

# One test process runs them all under pytest -n: the broker with ACLs starts once.
pytestmark = pytest.mark.xdist_group("kafka-acl")
SECURE_SH = REPO / "compose" / "local" / "secure.sh"
KAFKA_ACLS = REPO / "compose" / "local" / "kafka-acls.sh"
LIMITED = "conveyor-limited"
GRACE_S = 3  # --permanent-error-grace-s (60 s by default)
DRAIN_MS = 2000  # --max-drain-ms (20 s by default)
REQUESTS = 5

# The ACLs docs/security.md gives a worker, by resource of its model.
WORKER_ACLS: dict[str, tuple[str, ...]] = {
    "requests": ("Read", "Describe"),
    "results": ("Write", "Describe"),
    "dlq": ("Write", "Describe"),
    "group": ("Read",),
}


@dataclass(frozen=True)
class AclBroker:
    """Where the broker with ACLs listens, and how its limited user logs in."""

    bootstrap: str  # SASL_SSL, for workers
    internal: str  # PLAINTEXT on loopback, a super user: for the tests' own clients
    ca_file: Path
    password: str

    def worker_env(self, user: str = LIMITED) -> dict[str, str]:
        return {
            "CONVEYOR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "CONVEYOR_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "CONVEYOR_KAFKA_USERNAME": user,
            "CONVEYOR_KAFKA_PASSWORD": self.password,
            "CONVEYOR_KAFKA_CA_FILE": str(self.ca_file),
        }

    def grant(self, resource: str, name: str, operations: tuple[str, ...]) -> None:
        """Allow the limited user ``operations`` on the topic or group ``name``."""
        subprocess.run(
            [
                str(KAFKA_ACLS),
                *("--bootstrap-server", self.internal, "--add"),
                *("--allow-principal", f"User:{LIMITED}"),
                *(arg for operation in operations for arg in ("--operation", operation)),
                f"--{resource}",
                name,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclBroker]:
    run_dir = tmp_path_factory.mktemp("acl-run")
    kafka_port, redis_port = free_ports(range(3)), free_port()
    env = {
        **os.environ,
        "CONVEYOR_RUN_DIR": str(run_dir),
        "SECURE_ACLS": "1",
        "SECURE_KAFKA_PORT": str(kafka_port),
        "SECURE_REDIS_PORT": str(redis_port),
        "SECURE_PASSWORD": secrets.token_urlsafe(16),
    }
    started = subprocess.run(
        [str(SECURE_SH), "start"], env=env, capture_output=True, text=True, timeout=180
    )
    try:
        assert started.returncode == 0, started.stderr
        yield AclBroker(
            bootstrap=f"127.0.0.1:{kafka_port}",
            internal=f"127.0.0.1:{kafka_port + 2}",
            ca_file=run_dir / f"secure-{kafka_port}-{redis_port}-acl" / "tls" / "ca.pem",
            password=env["SECURE_PASSWORD"],
        )
    finally:
        subprocess.run([str(SECURE_SH), "stop"], env=env, capture_output=True, timeout=90)


class Model:
    """A model's topics on the broker with ACLs, its requests, and the limited user's ACLs."""

    def __init__(self, broker: AclBroker, name: str) -> None:
        self.broker, self.name = broker, name
        self.topics = topics_for(name)
        self.group = consumer_group(name)
        self.ids: list[str] = []

    def resource(self, role: str) -> tuple[str, str]:
        """(kafka-acls resource option, name) of ``role`` (a key of WORKER_ACLS)."""
        return ("group", self.group) if role == "group" else ("topic", getattr(self.topics, role))

    async def set_up(
        self, digits: list[tuple[bytes, int]], without: tuple[str, tuple[str, ...]]
    ) -> None:
        """Topics, ``REQUESTS`` requests and a poison one, and the worker ACLs less
        ``without`` (role, operations)."""
        settings = ClientSettings(kafka_bootstrap=self.broker.internal)
        await create_model_topics(settings, self.name, partitions=1)
        records, self.ids = digit_requests(digits, REQUESTS, self.name)
        poison = encode_request(
            b"not a png", request_id=f"{self.name}-poison", content_type=ContentType.PNG, source="t"
        )
        self.ids.append(f"{self.name}-poison")  # its dead letter needs WRITE on the DLQ
        await produce(self.broker.internal, self.topics.requests, [*records, poison])
        role, refused = without
        for each, operations in WORKER_ACLS.items():
            kept = tuple(op for op in operations if each != role or op not in refused)
            if kept:
                await asyncio.to_thread(self.broker.grant, *self.resource(each), kept)

    async def nothing_committed(self) -> None:
        async with kafka_admin(self.broker.internal) as admin:
            for _attempt in range(60):
                try:
                    offsets = await admin.list_consumer_group_offsets(self.group)
                    break
                except KafkaError as exc:  # the group's coordinator may still be starting
                    if not exc.retriable:
                        raise
                    await asyncio.sleep(0.5)  # the broker's own retry interval
            else:
                raise AssertionError(f"no coordinator for group {self.group} in 30 s")
        assert offsets == {}

    async def answered_by_another_worker(self, workers: Fleet, scenario: str) -> None:
        """A worker of the super user answers every request, each once."""
        workers.start(kafka_bootstrap=self.broker.bootstrap, env=self.broker.worker_env("conveyor"))
        counted = await tally_scenario(
            scenario, self.broker.internal, workers.base.redis_url, self.name, self.ids
        )
        check(counted, workers.logs())


@pytest.fixture
def model(acl_broker: AclBroker, model_name: str) -> Model:
    return Model(acl_broker, model_name)


def _limited_worker(workers: Fleet, model: Model, *options: str) -> WorkerProcess:
    return workers.start(
        *options, kafka_bootstrap=model.broker.bootstrap, env=model.broker.worker_env()
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("without", "named"),
    [
        pytest.param(("group", ("Read",)), "READ on group {group}", id="group-read"),
        pytest.param(("results", ("Write",)), "WRITE on topic {results}", id="results-write"),
        pytest.param(("dlq", ("Write",)), "WRITE on topic {dlq}", id="dlq-write"),
        pytest.param(("requests", ("Read",)), "READ on topic {requests}", id="requests-read"),
        # READ and WRITE include DESCRIBE: without it, neither is left.
        pytest.param(
            ("requests", ("Read", "Describe")),
            "may not describe topics {requests}: grant it READ on topic {requests}",
            id="requests-describe",
        ),
        pytest.param(
            ("results", ("Write", "Describe")),
            "may not describe topics {results}: grant it WRITE on topic {results}",
            id="results-describe",
        ),
    ],
)
async def test_without_an_acl_the_worker_exits_3_naming_it_and_commits_nothing(
    without: tuple[str, tuple[str, ...]],
    named: str,
    model: Model,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    await model.set_up(digits, without)
    started = time.time()
    worker = _limited_worker(workers, model, "--permanent-error-grace-s", str(GRACE_S))
    status = await worker.exited(120)
    exited = time.time()
    log = worker.log()
    assert status == 3, log
    topics = model.topics
    acl = named.format(
        group=model.group, requests=topics.requests, results=topics.results, dlq=topics.dlq
    )
    assert acl in log.splitlines()[-1], log
    assert "Traceback" not in log
    # Refused while serving: one line when it starts, then the exit after the grace.
    naming = [line for line in log.splitlines() if " ERROR " in line and acl in line]
    assert len(naming) <= 1, log
    after_refusal = (
        f"{exited - logged_at(naming[0]):.1f} s after the first refusal (grace {GRACE_S} s)"
        if naming
        else "at start-up"
    )
    await model.nothing_committed()
    role, operations = without
    scenario = f"Kafka ACL without {'+'.join(operations).upper()} on the {role}"
    await model.answered_by_another_worker(workers, scenario)
    NOTES.append(
        f"{scenario}: exit {status} {exited - started:.1f} s after start, {after_refusal}; "
        f"names {acl}"
    )


@pytest.mark.timeout(240)
async def test_a_worker_stuck_on_a_refused_write_stops_on_sigterm_within_its_drain_bound(
    model: Model, workers: Fleet, digits: list[tuple[bytes, int]]
) -> None:
    await model.set_up(digits, ("results", ("Write",)))
    options = ("--permanent-error-grace-s", "600", "--max-drain-ms", str(DRAIN_MS))
    worker = _limited_worker(workers, model, *options)
    refused = f"WRITE on topic {model.topics.results}"
    await until_true(lambda: refused in worker.log(), "the refusal", 120, worker.log, [worker])
    signalled = time.monotonic()
    worker.signal(signal.SIGTERM)
    status = await worker.exited(60)
    took = time.monotonic() - signalled
    assert status == 0, worker.log()
    assert "drain cut short" in worker.log()
    assert took < DRAIN_MS / 1000 + CLOSE_S, worker.log()
    await model.nothing_committed()
    scenario = "SIGTERM while Kafka refuses WRITE on the results"
    await model.answered_by_another_worker(workers, scenario)
    NOTES.append(f"{scenario}: exit 0 {took:.1f} s after the signal (--max-drain-ms {DRAIN_MS})")
