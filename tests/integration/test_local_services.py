"""compose/local/: up.sh and down.sh start and stop exactly what they own.

Each test runs the scripts as a newcomer would, but on free ports picked here and
with a run folder of its own (CONVEYOR_RUN_DIR), so the shared broker and Redis
that other tests use are never touched. The Kafka jars cache is the default one,
so nothing is downloaded. Only one test starts Kafka (about 10 s on a small box).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from producers.testing import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "compose" / "local"
SCRIPT_TIMEOUT = 90  # seconds; a script that hangs fails the test instead of the suite


@dataclass(frozen=True)
class Local:
    """One private set of local services: its ports, run folder and environment."""

    kafka_port: int
    redis_port: int
    run_dir: Path
    env: dict[str, str]

    @property
    def kafka_pidfile(self) -> Path:
        return self.run_dir / f"kafka-{self.kafka_port}" / "kafka.pid"

    @property
    def redis_pidfile(self) -> Path:
        return self.run_dir / f"redis-{self.redis_port}" / "redis.pid"

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(LOCAL / script), *args],
            env=self.env | env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT,
            check=False,
        )

    def processes(self) -> dict[int, str]:
        """Every live process whose command line names our run folder or ports."""
        markers = (
            str(self.run_dir),
            f"127.0.0.1:{self.kafka_port}",
            f"127.0.0.1:{self.redis_port}",
            f"127.0.0.1 {self.kafka_port}",  # ready.py's arguments
            f"127.0.0.1 {self.redis_port}",
        )
        found: dict[int, str] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:  # the process exited while we looked
                continue
            if any(marker in cmdline for marker in markers):
                found[int(proc.name)] = cmdline
        return found


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Local]:
    """Private ports and run folder; down.sh afterwards whatever the test did."""
    kafka_port = free_ports((0, 1))  # Kafka's controller listens on the next port
    redis_port = free_port()
    while redis_port in (kafka_port, kafka_port + 1):
        redis_port = free_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.update(
        KAFKA_PORT=str(kafka_port),
        KAFKA_CONTROLLER_PORT=str(kafka_port + 1),
        REDIS_PORT=str(redis_port),
        CONVEYOR_RUN_DIR=str(run_dir),
        READY_TIMEOUT="60",
    )
    services = Local(kafka_port, redis_port, run_dir, env)
    yield services
    services.run("down.sh")
    assert services.processes() == {}


@pytest.mark.timeout(150)
def test_up_is_idempotent_and_down_stops_everything(local: Local) -> None:
    first = local.run("up.sh")
    assert first.returncode == 0, first.stderr
    kafka_pid = int(local.kafka_pidfile.read_text())
    redis_pid = int(local.redis_pidfile.read_text())
    assert f"kafka.Kafka {local.run_dir}" in _cmdline(kafka_pid)
    assert f"redis-server 127.0.0.1:{local.redis_port}" in _cmdline(redis_pid)

    second = local.run("up.sh")
    assert second.returncode == 0, second.stderr
    assert "already running" in second.stderr
    assert int(local.kafka_pidfile.read_text()) == kafka_pid
    assert int(local.redis_pidfile.read_text()) == redis_pid
    # Exactly one broker and one Redis: no second copy started behind the pid files.
    assert set(local.processes()) == {kafka_pid, redis_pid}
    ready = subprocess.run(
        [
            "python3",
            str(LOCAL / "ready.py"),
            "kafka",
            "127.0.0.1",
            str(local.kafka_port),
            "--timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert ready.returncode == 0, ready.stderr

    down = local.run("down.sh")
    assert down.returncode == 0, down.stderr
    assert local.processes() == {}
    assert not local.kafka_pidfile.exists()
    assert not local.redis_pidfile.exists()
    assert not _listening(local.kafka_port)
    assert not _listening(local.redis_port)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("taken", ["kafka", "controller", "redis"])
def test_port_in_use_fails_fast_naming_port_and_log(local: Local, taken: str) -> None:
    port = {
        "kafka": local.kafka_port,
        "controller": local.kafka_port + 1,
        "redis": local.redis_port,
    }[taken]
    service = "redis" if taken == "redis" else "kafka"
    log_file = (
        local.run_dir / f"redis-{local.redis_port}" / "redis.log"
        if service == "redis"
        else local.run_dir / f"kafka-{local.kafka_port}" / "logs" / "server.log"
    )
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        result = local.run("up.sh")  # subprocess timeout bounds the time it may take

    assert result.returncode != 0
    error = result.stderr[result.stderr.index("ERROR") :].strip()
    assert f"port {port}" in error
    assert str(log_file) in error
    assert "\n\n" not in error  # one paragraph
    # No broker was started; with Redis's port taken nothing was (Redis starts first).
    pidfile = local.redis_pidfile if service == "redis" else local.kafka_pidfile
    assert not pidfile.exists()
    left = local.processes()
    assert not any("kafka.Kafka" in cmdline for cmdline in left.values())
    if service == "redis":
        assert left == {}


@pytest.mark.timeout(30)
def test_down_with_nothing_running_touches_nothing(local: Local) -> None:
    shared = sorted((ROOT / ".run").glob("*/*.pid"))
    before = {path: (path.read_text(), path.stat().st_mtime_ns) for path in shared}

    result = local.run("down.sh")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert not local.run_dir.exists()  # no folder, pid file or log created
    assert {path: (path.read_text(), path.stat().st_mtime_ns) for path in shared} == before


@pytest.mark.timeout(60)
def test_redis_keeps_its_data_across_a_restart_unless_told_not_to(local: Local) -> None:
    def restart_with_a_key(**env: str) -> bytes | None:
        started = local.run("redis.sh", "start", **env)
        assert started.returncode == 0, started.stderr
        with redis.Redis(port=local.redis_port) as client:
            client.set("conveyor:result:kept", b"answer")
        assert local.run("redis.sh", "stop").returncode == 0
        started = local.run("redis.sh", "start", **env)
        assert started.returncode == 0, started.stderr
        with redis.Redis(port=local.redis_port) as client:
            value: bytes | None = client.get("conveyor:result:kept")
            client.flushall()
        assert local.run("redis.sh", "stop").returncode == 0
        return value

    assert restart_with_a_key() == b"answer"  # the append-only file, by default
    data_dir = local.run_dir / f"redis-{local.redis_port}"
    assert any(data_dir.glob("appendonlydir/*.aof"))
    assert restart_with_a_key(REDIS_APPENDONLY="no") is None
    refused = local.run("redis.sh", "start", REDIS_APPENDONLY="maybe")
    assert refused.returncode != 0
    assert "REDIS_APPENDONLY must be yes" in refused.stderr
