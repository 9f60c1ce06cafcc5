"""Authenticated, encrypted connections: Kafka over SASL_SSL (SCRAM-SHA-512), Redis over TLS
with an ACL user, both started once for this module by ``compose/local/secure.sh``.

A real worker, the SDK and the CLI serve requests over them; a wrong password or an
untrusted CA makes the worker stop at once with an error naming the endpoint and the
cause; the configured secrets never show in logs, output or ``/metrics``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from producers import AsyncClient, ClientSettings, ServiceUnavailable, Status
from producers.admin import create_model_topics
from producers.testing import Fleet, WorkerProcess, free_port, free_ports, http_get
from tests.conftest import REPO
from tests.harness import requests_by_status

# One test process runs them all under pytest -n: the secured broker starts once.
pytestmark = pytest.mark.xdist_group("secured")
SECURE_SH = REPO / "compose" / "local" / "secure.sh"
_FAIL_WITHIN_S = 30


@dataclass(frozen=True)
class Secured:
    """Where the secured services listen and how to log in."""

    bootstrap: str
    redis_url: str
    ca_file: Path
    user: str
    password: str

    def env(self, **overrides: str) -> dict[str, str]:
        """CONVEYOR_* variables for a worker, SDK or CLI process; overrides win."""
        env = {
            "CONVEYOR_KAFKA_BOOTSTRAP": self.bootstrap,
            "CONVEYOR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "CONVEYOR_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "CONVEYOR_KAFKA_USERNAME": self.user,
            "CONVEYOR_KAFKA_PASSWORD": self.password,
            "CONVEYOR_KAFKA_CA_FILE": str(self.ca_file),
            "CONVEYOR_REDIS_URL": self.redis_url,
            "CONVEYOR_REDIS_USERNAME": self.user,
            "CONVEYOR_REDIS_PASSWORD": self.password,
            "CONVEYOR_REDIS_CA_FILE": str(self.ca_file),
        }
        return {**env, **{f"CONVEYOR_{name.upper()}": value for name, value in overrides.items()}}

    def settings(self, **overrides: object) -> ClientSettings:
        given: dict[str, object] = {
            "kafka_bootstrap": self.bootstrap,
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_username": self.user,
            "kafka_password": self.password,
            "kafka_ca_file": self.ca_file,
            "redis_url": self.redis_url,
            "redis_username": self.user,
            "redis_password": self.password,
            "redis_ca_file": self.ca_file,
            "connect_timeout_s": 10,
        }
        return ClientSettings(**{**given, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    run_dir = tmp_path_factory.mktemp("secure-run")
    kafka_port, redis_port = free_ports(range(3)), free_port()
    env = {
        **os.environ,
        "CONVEYOR_RUN_DIR": str(run_dir),
        "SECURE_KAFKA_PORT": str(kafka_port),
        "SECURE_REDIS_PORT": str(redis_port),
        "SECURE_PASSWORD": secrets.token_urlsafe(16),
    }
    started = subprocess.run(
        [str(SECURE_SH), "start"], env=env, capture_output=True, text=True, timeout=150
    )
    try:
        assert started.returncode == 0, started.stderr
        assert env["SECURE_PASSWORD"] not in started.stderr + started.stdout
        yield Secured(
            bootstrap=f"127.0.0.1:{kafka_port}",
            redis_url=f"rediss://127.0.0.1:{redis_port}/0",
            ca_file=run_dir / f"secure-{kafka_port}-{redis_port}" / "tls" / "ca.pem",
            user="conveyor",
            password=env["SECURE_PASSWORD"],
        )
    finally:
        subprocess.run([str(SECURE_SH), "stop"], env=env, capture_output=True, timeout=90)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that signed nothing the services present: trusting only it must fail."""
    folder = tmp_path_factory.mktemp("other-ca")
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=someone else", "-keyout", str(folder / "ca.key")),
            *("-out", str(folder / "ca.pem")),
        ],
        check=True,
        capture_output=True,
    )
    return folder / "ca.pem"


@pytest.fixture(scope="module")
def digit_png(digits: list[tuple[bytes, int]]) -> bytes:
    return digits[0][0]


@pytest.fixture
async def topics(secured: Secured, model_name: str) -> str:
    await create_model_topics(secured.settings(), model_name, partitions=1)
    return model_name


def _worker(workers: Fleet, secured: Secured, **overrides: str) -> WorkerProcess:
    """A worker on the secured services, given the secure settings by CONVEYOR_* variables."""
    return workers.start(
        "--metrics-host",
        "127.0.0.1",
        kafka_bootstrap=secured.bootstrap,
        redis_url=secured.redis_url,
        env=secured.env(**overrides),
        metrics_port=free_port(),
    )


@pytest.mark.timeout(180)
async def test_worker_sdk_and_cli_serve_over_sasl_ssl_and_tls_without_leaking_secrets(
    secured: Secured, topics: str, digit_png: bytes, workers: Fleet, tmp_path: Path
) -> None:
    worker = _worker(workers, secured)
    port = worker.config.metrics_port
    try:
        async with AsyncClient(secured.settings()) as client:
            request_id = await client.submit(digit_png, model=topics)
            result = await client.wait(request_id, timeout=90)
        assert result.status is Status.ok, worker.log()

        image = tmp_path / "digit.png"
        image.write_bytes(digit_png)
        cli = await asyncio.to_thread(
            subprocess.run,
            [
                *(sys.executable, "-m", "producers.cli", "submit", str(image)),
                *("--model", topics, "--wait", "--timeout", "60"),
            ],
            cwd=REPO,
            env={**os.environ, **secured.env()},
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert cli.returncode == 0, cli.stderr + worker.log()
        assert orjson.loads(cli.stdout.splitlines()[0])["status"] == "ok"
        metrics = (await http_get(port, "/metrics"))[1].decode()
    finally:
        worker.stop()
    assert requests_by_status(metrics, topics).get("ok", 0) >= 2, metrics  # the SDK's and the CLI's
    for text in (worker.log(), metrics, cli.stdout, cli.stderr):
        assert secured.password not in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "endpoint", "cause"),
    [
        pytest.param(
            {"kafka_password": "wrong-kafka-pw"},
            "Kafka at {bootstrap}",
            "invalid credentials",
            id="kafka-password",
        ),
        pytest.param(
            {"redis_ca_file": "{other_ca}"},
            "Redis at {redis_url}",
            "CERTIFICATE_VERIFY_FAILED",
            id="redis-ca",
        ),
    ],
)
async def test_worker_refused_exits_at_once_naming_endpoint_and_cause(
    secured: Secured,
    other_ca: Path,
    workers: Fleet,
    overrides: dict[str, str],
    endpoint: str,
    cause: str,
) -> None:
    names = {"bootstrap": secured.bootstrap, "redis_url": secured.redis_url, "other_ca": other_ca}
    given = {name: value.format(**names) for name, value in overrides.items()}
    started = time.monotonic()
    worker = _worker(workers, secured, **given)
    try:
        code = await worker.exited(_FAIL_WITHIN_S)
    finally:
        worker.stop()
    log = worker.log()
    assert time.monotonic() - started < _FAIL_WITHIN_S
    assert code == 4, log
    assert f"cannot connect to {endpoint.format(**names)}" in log, log
    assert cause in log, log
    assert "Traceback" not in log
    passwords = [value for name, value in given.items() if name.endswith("password")]
    for secret in (secured.password, *passwords):
        assert secret not in log


async def test_sdk_with_untrusted_ca_or_wrong_password_says_which_service_and_why(
    secured: Secured, other_ca: Path, topics: str
) -> None:
    """Kafka's untrusted CA and Redis' wrong password: the cases the worker test leaves out."""
    async with AsyncClient(secured.settings(kafka_ca_file=other_ca)) as client:
        with pytest.raises(ServiceUnavailable) as kafka_error:
            await client.submit(b"7", model=topics, content_type="text/plain")
    assert f"Kafka at {secured.bootstrap}" in str(kafka_error.value)
    assert "CERTIFICATE_VERIFY_FAILED" in str(kafka_error.value)

    async with AsyncClient(secured.settings(redis_password="not-it")) as client:
        with pytest.raises(ServiceUnavailable) as redis_error:
            await client.result("some-id")
    assert f"Redis at {secured.redis_url}" in str(redis_error.value)
    assert "invalid username-password pair" in str(redis_error.value)
    assert secured.password not in str(kafka_error.value) + str(redis_error.value)
