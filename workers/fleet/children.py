"""One worker process of the host, as its supervisor sees it: started, relayed, asked, stopped.

A ``Child`` runs ``python -m workers.cli`` with the user's own flags and those that
make it one of many (its card, its name, a private metrics port): forked by the
host's fork server when there is one that serves (``workers.fleet.forkserver``: torch
already imported), else as a new process. Its output goes
to the supervisor's standard error a line at a time, each text line prefixed with
the child's name and each JSON line given a ``"process"`` field, so the host's log
stays one readable stream. The child's ``/readyz`` and ``/metrics`` are read on
its port, which its log announces (it listens on a free loopback port).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from workers.fleet.forkserver import ForkServer, terminate_with_parent
from workers.fleet.plan import Slot

log = logging.getLogger(__name__)

_METRICS_LINE = re.compile(rb"metrics and health on http://[^:\s]+:(\d+)")
_CACHE_LINE = re.compile(rb"compile cache: (\S+)")
_HTTP_TIMEOUT_S = 5.0
_KEPT_LINES = 20  # of each run's output, for the error it ended with


class _Process(Protocol):
    """What the supervisor uses of a started process: ``asyncio.subprocess.Process`` or
    the fork server's ``Forked``."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...
    def send_signal(self, signum: int) -> None: ...


class Child:
    """A worker process in one ``Slot``; start it again with ``start`` after it exits."""

    def __init__(
        self,
        slot: Slot,
        name: str,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        json: bool,
    ) -> None:
        self.slot = slot
        self.name = name
        self.module = module
        self.args = list(args)
        self.env = dict(env)
        self.json = json
        self.forks: ForkServer | None = None  # the host's fork server, when it has one
        self.port: int | None = None
        self.compile_cache: Path | None = None  # the folder its log names, once it does
        self.started_at = 0.0
        self.starts = 0
        self.ready_seen = False  # its /readyz answered 200 since it last started
        self.last_lines: collections.deque[str] = collections.deque(maxlen=_KEPT_LINES)
        self._proc: _Process | None = None
        self._relay: asyncio.Task[None] | None = None

    @property
    def argv(self) -> list[str]:
        """Its command line when it starts as a new process."""
        return [sys.executable, "-m", self.module, *self.args]

    async def start(self) -> None:
        self.port = None
        self.ready_seen = False
        self.last_lines.clear()
        self._proc = await self._forked() or await self._spawned()
        self.started_at = time.monotonic()
        self.starts += 1
        log.info("process %s started: pid %d", self.name, self._proc.pid)
        self._relay = asyncio.create_task(self._relay_output(self._proc), name=f"relay-{self.name}")

    async def _forked(self) -> _Process | None:
        if self.forks is None or not self.forks.serving:
            return None
        try:
            return await self.forks.launch(self.module, self.args, self.env)
        except OSError as exc:
            log.warning("%s starts as a new process: %s", self.name, exc)
            return None

    async def _spawned(self) -> _Process:
        # A session of its own: a Ctrl-C at the terminal (or a signal to the supervisor's
        # process group) reaches only the supervisor, which passes one SIGTERM on; a
        # second one would end the child's drain. If the supervisor dies without doing
        # so, the kernel sends the child SIGTERM itself (Linux), so none is orphaned.
        # A forked child has the same session and signal of its own.
        return await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=terminate_with_parent,
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def wait(self) -> int:
        """Its exit status once it exits (a signal's as ``-signum``), its output relayed."""
        assert self._proc is not None, "the child was never started"
        status = await self._proc.wait()
        if self._relay is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._relay
        return status

    def signal(self, signum: signal.Signals) -> None:
        if self.running:
            assert self._proc is not None
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signum)

    async def ready(self) -> bool:
        """Its ``/readyz`` answers 200 (model loaded, partitions assigned, results durable)."""
        if not self.running or self.port is None:
            return False
        try:
            status, _ = await http_get(self.port, "/readyz")
        except (OSError, TimeoutError):
            return False
        self.ready_seen = self.ready_seen or status == 200
        return status == 200

    async def metrics(self) -> str | None:
        """Its ``/metrics`` exposition, or None while it does not answer."""
        if not self.running or self.port is None:
            return None
        try:
            status, body = await http_get(self.port, "/metrics")
        except (OSError, TimeoutError):
            return None
        return body.decode(errors="replace") if status == 200 else None

    async def _relay_output(self, proc: _Process) -> None:
        assert proc.stdout is not None
        out = sys.stderr.buffer
        prefix = f"[{self.name}] ".encode()
        field = f'{{"process": "{self.name}", '.encode()
        while line := await proc.stdout.readline():
            self.last_lines.append(line.decode(errors="replace"))
            if self.port is None:
                found = _METRICS_LINE.search(line)
                if found:
                    self.port = int(found.group(1))
            elif self.compile_cache is None:
                cached = _CACHE_LINE.search(line)
                if cached:
                    self.compile_cache = Path(cached.group(1).decode(errors="replace"))
            if self.json and line.startswith(b"{"):
                out.write(field + line[1:] if line[1:2] != b"}" else line)
            else:
                out.write(prefix + line)
            out.flush()


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """(status, body) of one GET to a child's health port; OSError while it does not listen."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _HTTP_TIMEOUT_S)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), _HTTP_TIMEOUT_S)  # it closes after answering
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        raise OSError(f"no HTTP answer from 127.0.0.1:{port}{path}") from None
