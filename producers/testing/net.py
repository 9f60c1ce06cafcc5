"""Ports for services a test or benchmark starts, and a worker's HTTP endpoints read plainly."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Iterable

_PORTS = range(10000, 20000)  # below the kernel's ephemeral range (32768 and up)


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """(status, body) of one GET; raises OSError while nothing listens on the port."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # the server closes after answering
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def free_port() -> int:
    """A free port from 10000-19999, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is in the ephemeral range, where any
    client connection opened before the server binds may take it as its local
    port; Kafka then exits at start-up. Ports derived from this one by adding up to
    11000 (SeaweedFS's, a cluster's) stay below 32768 too.
    """
    for _ in range(1000):
        port = random.choice(_PORTS)
        if _bindable(port):
            return port
    raise RuntimeError("no free port in 10000-19999 on 127.0.0.1")


def free_ports(offsets: Iterable[int]) -> int:
    """A free port ``p`` such that ``p + offset`` is free too for every offset: for a
    service that takes several ports at fixed distances from the one it is given."""
    wanted = list(offsets)
    for _ in range(100):
        base = free_port()
        if all(1024 < base + n < 65536 and _bindable(base + n) for n in wanted):
            return base
    raise RuntimeError(f"no free port p with p + {wanted} free too on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
