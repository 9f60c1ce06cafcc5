"""Ports for services a test or benchmark starts, and a worker's HTTP endpoints read plainly."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

_PORTS = range(10000, 20000)  # below the kernel's ephemeral range (32768 and up)
_CLAIMS = Path(tempfile.gettempdir()) / f"conveyor-free-ports-{os.getuid()}.json"
# How long a port handed out stays taken: far longer than a service takes to bind it.
_CLAIM_S = 900.0


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """(status, body) of one GET; raises OSError while nothing listens on the port."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    try:
        # Connection: close, so that a server that keeps connections open closes this one.
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
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
    11000 (SeaweedFS's, a cluster's) stay below 32768 too. No other process on this
    host is handed the same port for a while (``free_ports``).
    """
    return free_ports((0,))


def free_ports(offsets: Iterable[int]) -> int:
    """A free port ``p`` such that ``p + offset`` is free too for every offset: for a
    service that takes several ports at fixed distances from the one it is given.

    The ports are claimed, host-wide, for 15 minutes: processes that pick ports at the
    same time (the suite's workers side by side) never get the same one, even before
    the first has bound it.
    """
    wanted = list(offsets)
    with _claims() as claimed:
        for _ in range(1000):
            base = random.choice(_PORTS)
            ports = [base + n for n in wanted]
            if all(_unclaimed(port, claimed) and _bindable(port) for port in ports):
                now = time.time()
                claimed.update({str(port): now for port in ports})
                return base
    raise RuntimeError(f"no free port p with p + {wanted} free too on 127.0.0.1")


@contextlib.contextmanager
def _claims() -> Iterator[dict[str, float]]:
    """The ports handed out in the last ``_CLAIM_S`` seconds on this host (port: when),
    read and written back under an exclusive lock on their file."""
    with _CLAIMS.open("a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)  # released when the file is closed
        file.seek(0)
        text = file.read()
        try:
            found: dict[str, float] = json.loads(text) if text else {}
        except ValueError:
            found = {}  # a file cut short by a killed writer: forget its claims
        # Wall-clock time: the stamps are compared across processes.
        now = time.time()
        claimed = {port: when for port, when in found.items() if now - when < _CLAIM_S}
        yield claimed
        file.seek(0)
        file.truncate()
        file.write(json.dumps(claimed))


def _unclaimed(port: int, claimed: dict[str, float]) -> bool:
    return 1024 < port < 65536 and str(port) not in claimed


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
