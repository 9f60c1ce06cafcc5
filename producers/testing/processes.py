"""Worker processes seen from outside: launch ``conveyor worker``, watch it, stop or kill it.

A ``WorkerProcess`` is one child process with its output in a log file (so a
SIGKILL, a SIGSTOP or a SIGTERM drain is the real thing); a ``Fleet`` is the
workers of one test, benchmark or demo run, each started from one base
``WorkerConfig`` with more flags, and all stopped at its end. Readiness comes
from the worker itself: its log, and its ``/readyz`` endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypedDict, TypeVar

from producers.testing.net import http_get

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")
WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "producers.cli", "worker")
"""``conveyor worker`` run from the interpreter, so a ``cwd`` checkout's modules load."""
CLUSTER_SCHEME = "redis+cluster"
"""A Redis Cluster is named by ``redis+cluster://host:port/0`` (any node) here."""
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.1  # how often a process or a condition is looked at again
_METRICS_LINE = re.compile(r"metrics and health on http://[^:]+:(\d+)")
_ASSIGNED_LINE = re.compile(r"partitions assigned: (.*)$", re.MULTILINE)
_SERVING_LINE = "ready: serving"


def is_cluster(redis_url: str) -> bool:
    return redis_url.startswith(f"{CLUSTER_SCHEME}://")


def plain_url(redis_url: str) -> str:
    """The URL a worker or the SDK is given (``redis://``; a cluster says so elsewhere)."""
    return redis_url.replace(f"{CLUSTER_SCHEME}://", "redis://", 1)


class Changes(TypedDict, total=False):
    """``WorkerConfig`` fields that a worker of a fleet may have of its own."""

    model: str
    device: str
    env: Mapping[str, str]  # added to the base's
    kafka_bootstrap: str
    redis_url: str
    metrics_port: int
    cwd: Path | None


@dataclass(frozen=True)
class WorkerConfig:
    """How to run one ``conveyor worker``: where the services are, the model, more flags."""

    model_name: str
    kafka_bootstrap: str
    redis_url: str  # a ``redis+cluster://`` URL adds --redis-cluster
    model: str = "digits"  # --model: a built-in name, a file or a module:Class ("": none,
    # the models are in a host file's [[models]] tables)
    device: str = "cpu"
    options: tuple[str, ...] = ()  # more flags, after the others: the last one given wins
    env: Mapping[str, str] = field(default_factory=dict)  # over this process's environment
    metrics_port: int = 0  # 0: any free port (several workers share a host), read from the log
    cwd: Path | None = None  # a checkout to import the worker from (an earlier version)
    command: tuple[str, ...] = WORKER_COMMAND

    def argv(self) -> list[str]:
        return [
            *self.command,
            *(("--model", self.model, "--model-name", self.model_name) if self.model else ()),
            *("--kafka-bootstrap", self.kafka_bootstrap, "--redis-url", plain_url(self.redis_url)),
            *(["--redis-cluster"] if is_cluster(self.redis_url) else []),
            *("--device", self.device, "--metrics-port", str(self.metrics_port)),
            *self.options,
        ]

    def but(self, *options: str, **changes: Unpack[Changes]) -> WorkerConfig:
        """This config with more flags and other fields changed (``env`` adds to this one's)."""
        if "env" in changes:
            changes["env"] = {**self.env, **changes["env"]}
        return dataclasses.replace(self, options=(*self.options, *options), **changes)


class WorkerExited(RuntimeError):
    """A worker exited while it was still needed; the message names its status and its log."""


class WorkerProcess:
    """One ``conveyor worker`` child process, its stdout and stderr appended to ``log_path``.

    With ``new_session``, it runs in a session of its own, so a Ctrl-C at the
    terminal reaches only its parent, which then stops it with one SIGTERM.
    """

    def __init__(self, config: WorkerConfig, log_path: Path, *, new_session: bool = False) -> None:
        self.config = config
        self.log_path = log_path
        self._new_session = new_session
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this run's lines begin (an earlier run's may come first)

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the fd
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                self.config.argv(),
                cwd=self.config.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.config.env},
                start_new_session=self._new_session,
            )
        return self

    @property
    def pid(self) -> int:
        return self._process().pid

    @property
    def default_id(self) -> str:
        """The id it writes into results' ``worker`` field unless given ``--worker-id``."""
        return f"{socket.gethostname()}-{self.pid}"

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def children(self) -> list[int]:
        """The pids of its live worker processes (a host's), from /proc: its children, and
        the children of its fork server (``workers.fleet.forkserver``) in its stead."""
        parents: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that ended meanwhile
            if fields[0] not in ("Z", "X"):
                parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found = []
        for pid in parents.get(self.pid, []):
            found += parents.get(pid, []) if _fork_server(pid) else [pid]
        return sorted(found)

    def signal(self, signum: signal.Signals) -> None:
        self._process().send_signal(signum)

    def pause(self) -> None:
        """SIGSTOP: frozen, its connections open, until ``resume``."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> int:
        """SIGKILL, and its status once it is gone."""
        self.signal(signal.SIGKILL)
        return self.wait()

    def wait(self, timeout: float = 60) -> int:
        """Its exit status; raises ``subprocess.TimeoutExpired`` if it runs on past ``timeout``."""
        return self._process().wait(timeout)

    async def exited(self, timeout_s: float = 60) -> int:
        """``wait`` without blocking the event loop."""
        return await asyncio.to_thread(self.wait, timeout_s)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> int | None:
        """SIGTERM and wait for the drain; SIGKILL if it takes longer than ``timeout``.
        Its exit status (None if it was never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        return self._proc.wait()

    async def aclose(self) -> None:
        """``stop`` without blocking the event loop; a cancelled caller does not cut it short."""
        await asyncio.shield(asyncio.to_thread(self.stop))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _run_log(self) -> str:
        """The lines of this run only."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def metrics_port(self) -> int | None:
        """The port of its /metrics, /healthz and /readyz, once it listens (its log says so)."""
        if self.config.metrics_port:
            return self.config.metrics_port
        found = _METRICS_LINE.search(self._run_log())
        return int(found.group(1)) if found else None

    def assigned_partitions(self) -> set[int] | None:
        """The partitions of its latest assignment (from its log); None before its first."""
        lines = _ASSIGNED_LINE.findall(self._run_log())
        return {int(p) for p in re.findall(r"\[(\d+)\]", lines[-1])} if lines else None

    def serving(self) -> bool:
        """It has loaded its model, connected and started its pipeline (its log says so)."""
        return _SERVING_LINE in self._run_log()

    async def ready(self) -> bool:
        """Its /readyz answers 200: serving, with partitions, its results becoming durable."""
        port = self.metrics_port()
        if port is None:
            return False
        try:
            status, _body = await http_get(port, "/readyz")
        except (OSError, TimeoutError):
            return False
        return status == 200

    async def until_serving(self, timeout_s: float = 120) -> None:
        await until(self.serving, "the worker serves", timeout_s, self.log, [self])

    async def until_ready(self, timeout_s: float = 120) -> None:
        await until(self.ready, "the worker is ready (/readyz 200)", timeout_s, self.log, [self])

    async def unless_it_dies(self, work: Awaitable[T]) -> T:
        """Await ``work``; raise ``WorkerExited`` as soon as this worker exits instead."""
        return await unless_one_exits([self], work)

    def _process(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"the worker logging to {self.log_path} was never started")
        return self._proc

    def __enter__(self) -> Self:
        return self if self._proc is not None else self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Fleet:
    """The workers of one run, each started from ``base`` with more flags; ``stop_all`` (or
    leaving ``with`` / ``async with``) stops every one. Logs: ``log_dir/worker-N.log``."""

    def __init__(self, base: WorkerConfig, log_dir: Path, *, new_session: bool = False) -> None:
        self.base, self.log_dir, self._new_session = base, log_dir, new_session
        self.started: list[WorkerProcess] = []

    def start(self, *options: str, **changes: Unpack[Changes]) -> WorkerProcess:
        """A worker of ``base.but(*options, **changes)``, started."""
        path = self.log_dir / f"worker-{len(self.started)}.log"
        worker = WorkerProcess(
            self.base.but(*options, **changes), path, new_session=self._new_session
        )
        self.started.append(worker.start())
        return worker

    @property
    def running(self) -> list[WorkerProcess]:
        return [worker for worker in self.started if worker.running()]

    def logs(self) -> str:
        return "\n".join(worker.log() for worker in self.started)

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()

    async def aclose(self) -> None:
        await asyncio.gather(*(worker.aclose() for worker in self.started))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def until_all_ready(
    workers: Sequence[WorkerProcess], timeout_s: float = 120, settle_s: float = 0.0
) -> float:
    """Wait until every worker's /readyz answers 200, and again ``settle_s`` later (the
    group has settled: no rebalance took partitions away meanwhile); returns the seconds
    it took. Raises ``WorkerExited`` if one exits, ``TimeoutError`` past ``timeout_s``."""
    started = time.monotonic()
    while True:

        async def all_ready() -> bool:
            return all(await asyncio.gather(*(w.ready() for w in workers)))

        await until(
            all_ready, "every worker ready (/readyz 200)", timeout_s, _logs(workers), workers
        )
        if not settle_s:
            return time.monotonic() - started
        await asyncio.sleep(settle_s)  # the settling time is the point: not a readiness wait
        if await all_ready():
            return time.monotonic() - started


async def unless_one_exits(workers: Iterable[WorkerProcess], work: Awaitable[T]) -> T:
    """Await ``work``; raise ``WorkerExited`` as soon as one of ``workers`` exits instead."""
    watched = list(workers)
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                return task.result()
            _raise_if_exited(watched)
    finally:
        if not task.done():
            task.cancel()
            # Let a cancelled wait give back its connections before going on.
            await asyncio.gather(task, return_exceptions=True)


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout_s: float,
    logs: Callable[[], str] = str,
    workers: Sequence[WorkerProcess] = (),
) -> None:
    """Poll ``condition()`` (sync or async) until it is true. Raises ``TimeoutError`` naming
    ``what`` with the end of ``logs()`` past ``timeout_s``, ``WorkerExited`` once one of
    ``workers`` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = condition()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        _raise_if_exited(workers)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true: {what}, within {timeout_s} s\n{logs()[-5000:]}")
        await asyncio.sleep(_POLL_S)  # polling interval, not a wait for readiness


def _raise_if_exited(workers: Iterable[WorkerProcess]) -> None:
    for worker in workers:
        if worker.returncode is not None:
            raise WorkerExited(
                f"the worker exited with status {worker.returncode}; its log is {worker.log_path}"
            )


def _logs(workers: Sequence[WorkerProcess]) -> Callable[[], str]:
    return lambda: "\n".join(worker.log() for worker in workers)


def _fork_server(pid: int) -> bool:
    try:
        return b"workers.fleet.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
