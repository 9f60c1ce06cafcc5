"""A ``conveyor gateway`` child process, for the tests and benchmarks that call it over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from producers.testing.net import free_port, http_get
from producers.testing.processes import until

GATEWAY_COMMAND: tuple[str, ...] = (sys.executable, "-m", "producers.cli", "gateway")


class GatewayProcess:
    """One gateway on a free loopback port, its output appended to ``log_path``."""

    def __init__(
        self,
        kafka_bootstrap: str,
        redis_url: str,
        log_path: Path,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        """``host:port``, as tritonclient takes it."""
        self.log_path = log_path
        self._argv = [
            *GATEWAY_COMMAND,
            *("--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url),
            *("--port", str(self.port)),
            *options,
        ]
        self._env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self._env},
            )
        return self

    async def ready(self) -> bool:
        """Whether ``/v2/health/ready`` answers 200 (Kafka and Redis reachable)."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"the gateway is not running; its log:\n{self.log()[-3000:]}")
        try:
            status, _ = await http_get(self.port, "/v2/health/ready")
        except OSError:
            return False
        return status == 200

    async def until_ready(self, timeout_s: float = 60) -> None:
        await until(self.ready, "the gateway is ready", timeout_s, self.log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15) -> int | None:
        """SIGTERM, SIGKILL after ``timeout``; its exit status (None if never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        return self._proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
