"""The health server, over real sockets on loopback: probes, scrapes and bad clients."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from producers.testing import until
from tests.fakes import FakeClock
from workers.observe.health import Check, HealthServer
from workers.observe.metrics import Metrics

LOCAL = "127.0.0.1"


def make_server(checks: dict[str, Check] | None = None, **options: Any) -> HealthServer:
    return HealthServer(Metrics("digits"), checks or {}, host=LOCAL, port=0, **options)


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, return everything the server sent before closing."""
    reader, writer = await asyncio.open_connection(LOCAL, port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()


async def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    response = await exchange(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    assert int(headers["Content-Length"]) == len(body) or method == "HEAD"
    return int(status_line.split(" ")[1]), headers, body


async def test_metrics_endpoint() -> None:
    async with make_server({"model": lambda: True}) as server:
        status, headers, body = await get(server.port, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    ok = b'conveyor_requests_total{model="digits",role="primary",status="ok",version=""} 0.0'
    assert ok in body
    assert b'conveyor_ready{model="digits"} 1.0' in body  # readiness evaluated for the scrape


async def test_healthz_ok_while_the_heartbeat_is_recent() -> None:
    async with make_server() as server:
        status, _, body = await get(server.port, "/healthz?verbose=1")
    assert (status, body) == (200, b"ok\n")


async def test_healthz_fails_when_the_heartbeat_is_stale() -> None:
    clock = FakeClock(100.0)
    async with make_server(clock=clock, heartbeat_s=3600, stale_after_s=10) as server:
        clock.now += 30  # as if the loop had been blocked for 30 s
        status, _, body = await get(server.port, "/healthz")
    assert status == 503
    assert b"last heartbeat 30.0 s ago" in body


async def test_heartbeat_keeps_liveness_fresh() -> None:
    clock = FakeClock(100.0)
    async with make_server(clock=clock, heartbeat_s=0.01, stale_after_s=10) as server:
        clock.now += 30
        await until(lambda: server.liveness()[0], "a heartbeat since the clock moved", 5)
        status, _, _ = await get(server.port, "/healthz")
    assert status == 200


async def test_readyz_ok_when_every_check_passes() -> None:
    async def redis_ping() -> bool:
        return True

    checks: dict[str, Check] = {"model": lambda: True, "redis": redis_ping}
    async with make_server(checks) as server:
        status, headers, body = await get(server.port, "/readyz")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"ready": True, "checks": {"model": "ok", "redis": "ok"}}


async def test_readyz_names_each_failed_check() -> None:
    async def hangs() -> bool:
        await asyncio.sleep(60)
        return True

    def broken() -> bool:
        raise ConnectionError("redis down")

    checks: dict[str, Check] = {
        "model": lambda: True,
        "assignment": lambda: False,
        "redis": broken,
        "kafka": hangs,
    }
    server = make_server(checks, check_timeout_s=0.05)
    async with server:
        status, _, body = await get(server.port, "/readyz")
        metrics_body = (await get(server.port, "/metrics"))[2]
    assert status == 503
    assert json.loads(body) == {
        "ready": False,
        "checks": {
            "model": "ok",
            "assignment": "failed",
            "redis": "ConnectionError: redis down",
            "kafka": "no answer within 0.05 s",
        },
    }
    assert b'conveyor_ready{model="digits"} 0.0' in metrics_body


async def test_head_sends_headers_only() -> None:
    async with make_server({"model": lambda: True}) as server:
        status, headers, body = await get(server.port, "/readyz", method="HEAD")
    assert status == 200
    assert int(headers["Content-Length"]) > 0
    assert body == b""


async def test_other_methods_and_paths() -> None:
    async with make_server() as server:
        status, headers, _ = await get(server.port, "/metrics", method="POST")
        assert status == 405
        assert headers["Allow"] == "GET, HEAD"
        assert (await get(server.port, "/"))[0] == 404
        assert (await get(server.port, "/metrics/extra"))[0] == 404


@pytest.mark.parametrize(
    "raw",
    [
        b"hello\r\n\r\n",
        b"GET /healthz\r\n\r\n",
        b"GET /healthz SPDY/3\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
    ],
)
async def test_bad_requests_get_400(raw: bytes) -> None:
    async with make_server() as server:
        response = await exchange(server.port, raw)
    assert response.startswith(b"HTTP/1.1 400 Bad Request\r\n")


async def test_silent_client_is_dropped_after_the_timeout() -> None:
    async with make_server(request_timeout_s=0.1) as server:
        assert await exchange(server.port, b"GET /healthz HTTP/1.1\r\n") == b""


async def test_stop_ends_open_connections_and_frees_the_port() -> None:
    server = make_server(request_timeout_s=60)
    await server.start()
    port = server.port
    assert (await get(port, "/healthz"))[0] == 200
    reader, writer = await asyncio.open_connection(LOCAL, port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # and then nothing more
    for _ in range(20):  # a few loop turns: the server accepts it and starts reading
        await asyncio.sleep(0)
    await asyncio.wait_for(server.stop(), 5)
    # Closed by stop(), not after the 60 s request timeout.
    assert await asyncio.wait_for(reader.read(), 2) == b""
    writer.close()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.port
    with pytest.raises(OSError, match=r"refused|Connect call failed"):
        await asyncio.open_connection(LOCAL, port)


async def test_busy_port_names_the_setting() -> None:
    async with make_server() as first:
        second = HealthServer(Metrics("digits"), {}, host=LOCAL, port=first.port)
        with pytest.raises(OSError, match="--metrics-port"):
            await second.start()
