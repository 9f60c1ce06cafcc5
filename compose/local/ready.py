"""Readiness checks for the local services, with the standard library only.

Kafka: a real Metadata request (API key 3, version 4) that must list at least one
broker. Redis: a PING that must answer PONG. S3: an unsigned request for a bucket
that must be answered as S3 answers one (403 or 404 with an S3 error document),
which the gateway does once its filer is up. Polls until ready, until the
timeout, or until the watched process exits; never a fixed sleep.

Usage: python3 ready.py kafka|redis|s3 HOST PORT [--timeout S] [--pid PID]
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import time


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        buf += chunk
    return bytes(buf)


def kafka_brokers(host: str, port: int, timeout: float = 2.0) -> int:
    """Send MetadataRequest v4 (all topics, no auto-creation); return the broker count."""
    client_id = b"conveyor-ready"
    header = struct.pack(">hhih", 3, 4, 1, len(client_id)) + client_id
    body = struct.pack(">ib", -1, 0)  # topics = null (all), allow_auto_topic_creation = false
    request = header + body
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        response = _recv_exact(sock, size)
    correlation_id, _throttle_ms, brokers = struct.unpack(">iii", response[:12])
    if correlation_id != 1:
        raise ConnectionError(f"unexpected correlation id {correlation_id}")
    return brokers


def redis_ping(host: str, port: int, timeout: float = 2.0) -> bool:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


def s3_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    request = (
        f"GET /conveyor-ready-probe HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request.encode())
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b""
    return status in (b"403", b"404") and b"<Error>" in answer


def _alive(pid: int | None) -> bool:
    return pid is None or os.path.exists(f"/proc/{pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("service", choices=["kafka", "redis", "s3"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--pid", type=int, default=None, help="give up early if this process exits")
    args = parser.parse_args()

    deadline = time.monotonic() + args.timeout
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if not _alive(args.pid):
            print(f"{args.service} process {args.pid} exited during start-up", file=sys.stderr)
            return 1
        try:
            if args.service == "kafka":
                if kafka_brokers(args.host, args.port) > 0:
                    return 0
                last_error = "metadata lists no broker yet"
            elif args.service == "s3":
                if s3_answers(args.host, args.port):
                    return 0
                last_error = "the S3 gateway does not answer as S3 yet"
            elif redis_ping(args.host, args.port):
                return 0
        except (OSError, struct.error) as exc:
            last_error = str(exc) or type(exc).__name__
        time.sleep(0.2)  # poll interval between real checks, not a wait for readiness
    print(f"{args.service} on {args.host}:{args.port} not ready: {last_error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
