"""Authenticated, encrypted connections: Kafka over SASL_SSL (SCRAM-SHA-512), Redis over TLS
with an ACL user, both started once for this module by ``compose/local/secure.sh``.

A real worker, the SDK and the CLI serve requests over them; a wrong password or an
untrusted CA makes the worker stop at once with an error naming the endpoint and the
cause; the configured secrets never show in logs, output or ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from demo.models.digits import build_digits_model, heldout_digits
from producers import AsyncClient, ClientSettings, ServiceUnavailable, Status
from producers.admin import create_model_topics
from tests.integration.harness import REPO, WorkerProcess

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


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            first = int(sock.getsockname()[1])
        if first + count < 65536 and all(_free(first + n) for n in range(1, count)):
            return first
    raise RuntimeError("no run of free ports found")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    run_dir = tmp_path_factory.mktemp("secure-run")
    kafka_port, redis_port = _free_ports(3), _free_ports(1)
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
def digit_png() -> bytes:
    build_digits_model()  # the worker process loads the same cached artifact
    return heldout_digits()[0][0]


@pytest.fixture
async def topics(secured: Secured, model_name: str) -> str:
    await create_model_topics(secured.settings(), model_name, partitions=1)
    return model_name


def _worker(secured: Secured, model: str, log: Path, port: int, **overrides: str) -> WorkerProcess:
    """A worker given the secure settings through CONVEYOR_* variables only."""
    return WorkerProcess(
        model,
        secured.bootstrap,
        secured.redis_url,
        log,
        extra=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
        env=secured.env(**overrides),
    )


@pytest.mark.timeout(180)
async def test_worker_sdk_and_cli_serve_over_sasl_ssl_and_tls_without_leaking_secrets(
    secured: Secured, topics: str, digit_png: bytes, tmp_path: Path
) -> None:
    port = _free_ports(1)
    worker = _worker(secured, topics, tmp_path / "worker.log", port).start()
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
        metrics = await _get(port, "/metrics")
    finally:
        worker.stop()
    assert f'model="{topics}",status="ok"' in metrics
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
    digit_png: bytes,
    model_name: str,
    tmp_path: Path,
    overrides: dict[str, str],
    endpoint: str,
    cause: str,
) -> None:
    names = {"bootstrap": secured.bootstrap, "redis_url": secured.redis_url, "other_ca": other_ca}
    given = {name: value.format(**names) for name, value in overrides.items()}
    worker = _worker(secured, model_name, tmp_path / "worker.log", 0, **given)
    started = time.monotonic()
    worker.start()
    try:
        code = await asyncio.to_thread(worker.wait, _FAIL_WITHIN_S)
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


async def _get(port: int, path: str) -> str:
    """The body of one GET on the worker's metrics port."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # the server closes after answering
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return raw.partition(b"\r\n\r\n")[2].decode()
