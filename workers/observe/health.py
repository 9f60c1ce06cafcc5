"""One small HTTP port for operators: ``/metrics``, ``/healthz`` and ``/readyz``.

- ``/metrics``: the worker's Prometheus metrics (text format).
- ``/healthz`` (liveness): 200 while the event loop keeps running. A heartbeat
  task stamps the time every ``heartbeat_s``; a stamp older than ``stale_after_s``
  means the loop was blocked that long, and the answer is 503 with the age.
- ``/readyz`` (readiness): 200 only when every check the app supplied passes
  (model loaded and warmed, partitions assigned, Redis reachable, not draining);
  otherwise 503 with a JSON body naming each failed check and why.

The server speaks just enough HTTP/1.1 for probes and scrapers: GET and HEAD, one
request per connection, a bounded request head read under a timeout. It runs on
the worker's own event loop, so a loop that is stuck cannot answer at all, which a
probe's timeout turns into the same failure. The stdlib only: no web framework in
a GPU worker for three endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Check", "Exposition", "HealthServer", "Readiness"]

log = logging.getLogger(__name__)

# A readiness check: returns True when ready; False, a string saying why not, or raises
# when not. May be async.
Check = Callable[[], bool | str | Awaitable[bool | str]]

_MAX_HEAD_BYTES = 8192  # request line + headers; probes send about 200 bytes
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"


class Exposition(Protocol):
    """What ``/metrics`` serves: a worker's ``Metrics``, or a supervisor's merge of its
    processes' (``workers.fleet``), which reads them first (``render`` may be async)."""

    @property
    def content_type(self) -> str: ...

    def set_ready(self, ready: bool) -> None: ...

    def set_loop_lag(self, seconds: float) -> None: ...

    def render(self) -> bytes | Awaitable[bytes]: ...


@dataclass(frozen=True, slots=True)
class Readiness:
    """The outcome of the readiness checks."""

    ready: bool
    checks: dict[str, str]  # check name -> "ok", or why it failed


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    content_type: str
    body: bytes
    allow: str | None = None  # the Allow header of a 405


class HealthServer:
    """Serves the three endpoints while started (``async with HealthServer(...)``)."""

    def __init__(
        self,
        metrics: Exposition,
        checks: Mapping[str, Check],
        *,
        host: str,
        port: int,
        heartbeat_s: float = 1.0,
        stale_after_s: float = 10.0,
        check_timeout_s: float = 2.0,
        request_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        scoped: Callable[[str], Mapping[str, Check] | None] | None = None,
        documents: Mapping[str, Callable[[], object]] | None = None,
    ) -> None:
        """``host`` and ``port``: where to listen (the defaults are the settings'
        ``metrics_host`` and ``metrics_port``); ``port`` 0 picks a free port (tests), read
        the bound one from `port`. ``scoped``: the checks of ``/readyz?model=NAME`` (None
        for a name it does not know: 404). ``documents``: more paths, each answered with
        what its function returns, as JSON (a host's ``/host-file``)."""
        self._metrics = metrics
        self._documents = dict(documents or {})
        self._checks = dict(checks)
        self._scoped = scoped
        self._host = host
        self._requested_port = port
        self._heartbeat_s = heartbeat_s
        self._stale_after_s = stale_after_s
        self._check_timeout_s = check_timeout_s
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._last_beat = clock()
        self._server: asyncio.Server | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[object]] = set()

    @property
    def port(self) -> int:
        """The port actually listened on (differs from the one asked for when that was 0)."""
        if self._server is None:
            raise RuntimeError("the health server is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._last_beat = self._clock()
        try:
            self._server = await asyncio.start_server(
                self._serve, self._host, self._requested_port, limit=_MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot listen on {self._host}:{self._requested_port} for /metrics, "
                f"/healthz and /readyz ({exc.strerror}); choose another --metrics-port",
            ) from exc
        self._heartbeat = asyncio.create_task(self._beat(), name="health-heartbeat")
        log.info("metrics and health on http://%s:%d", self._host, self.port)

    async def stop(self) -> None:
        """Stop listening, end open connections and the heartbeat."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        tasks = [*self._clients, *([self._heartbeat] if self._heartbeat else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._heartbeat = None

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the checks -----------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        """(alive, explanation): alive while the heartbeat is recent."""
        age = self._clock() - self._last_beat
        if age > self._stale_after_s:
            return False, f"event loop stalled: last heartbeat {age:.1f} s ago"
        return True, "ok"

    async def readiness(self) -> Readiness:
        """Run every check (each bounded by ``check_timeout_s``); also sets conveyor_ready."""
        state = await self._run_checks(self._checks)
        self._metrics.set_ready(state.ready)
        return state

    async def _run_checks(self, checks: Mapping[str, Check]) -> Readiness:
        # Concurrently: a probe waits for the slowest check, not for their sum.
        results = await asyncio.gather(*(self._run_check(c) for c in checks.values()))
        outcomes = dict(zip(checks, results, strict=True))
        return Readiness(all(outcome == "ok" for outcome in outcomes.values()), outcomes)

    async def _run_check(self, check: Check) -> str:
        try:
            outcome = check()
            if inspect.isawaitable(outcome):
                outcome = await asyncio.wait_for(outcome, self._check_timeout_s)
        except TimeoutError:
            return f"no answer within {self._check_timeout_s:g} s"
        except Exception as exc:  # a failing check means "not ready", never a crashed probe
            return f"{type(exc).__name__}: {exc}"
        if isinstance(outcome, str):
            return outcome or "failed"
        return "ok" if outcome else "failed"

    async def _beat(self) -> None:
        while True:
            due = self._clock() + self._heartbeat_s
            await asyncio.sleep(self._heartbeat_s)
            self._last_beat = self._clock()
            self._metrics.set_loop_lag(max(0.0, self._last_beat - due))

    # -- HTTP -----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        try:
            response = await self._respond(reader)
            if response is not None:
                writer.write(response)
                await writer.drain()
        except ConnectionError:
            pass  # the client went away; nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if task is not None:
                self._clients.discard(task)

    async def _respond(self, reader: asyncio.StreamReader) -> bytes | None:
        """The bytes to send back, or None to just close (a client that sent nothing)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._request_timeout_s)
        except (asyncio.IncompleteReadError, TimeoutError):
            return None
        except asyncio.LimitOverrunError:
            return _encode(_text(400, f"request head over {_MAX_HEAD_BYTES} bytes\n"), head=False)
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _encode(_text(400, "malformed request line\n"), head=False)
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            response = _Response(405, _TEXT, b"only GET and HEAD\n", allow="GET, HEAD")
        else:
            path, _, query = target.partition("?")
            response = await self._route(path, urllib.parse.parse_qs(query))
        return _encode(response, head=method == "HEAD")

    async def _route(self, path: str, query: Mapping[str, list[str]]) -> _Response:
        if path == "/metrics":
            await self.readiness()  # keeps conveyor_ready current between probes
            body = self._metrics.render()
            if inspect.isawaitable(body):
                body = await body
            return _Response(200, self._metrics.content_type, body)
        if path == "/healthz":
            alive, why = self.liveness()
            return _text(200 if alive else 503, why + "\n")
        if path == "/readyz" and "model" in query and self._scoped is not None:
            name = query["model"][0]
            checks = self._scoped(name)
            if checks is None:
                return _text(404, f"no model {name!r} on this host\n")
            state = await self._run_checks(checks)
            scoped = {"ready": state.ready, "model": name, "checks": state.checks}
            return _Response(200 if state.ready else 503, _JSON, json.dumps(scoped).encode())
        if path == "/readyz":
            state = await self.readiness()
            body = json.dumps({"ready": state.ready, "checks": state.checks}).encode()
            return _Response(200 if state.ready else 503, _JSON, body)
        if path in self._documents:
            return _Response(200, _JSON, json.dumps(self._documents[path]()).encode())
        return _text(404, "not found: try /metrics, /healthz or /readyz\n")


def _text(status: int, body: str) -> _Response:
    return _Response(status, _TEXT, body.encode())


def _encode(response: _Response, *, head: bool) -> bytes:
    """The full HTTP/1.1 response; a HEAD answer keeps the headers and drops the body."""
    lines = [
        f"HTTP/1.1 {response.status} {_REASONS[response.status]}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Cache-Control: no-store",
        "Connection: close",
    ]
    if response.allow is not None:
        lines.append(f"Allow: {response.allow}")
    start = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return start if head else start + response.body
