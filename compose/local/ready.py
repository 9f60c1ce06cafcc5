"""Readiness checks for the local services, with the standard library only.

Kafka: a real Metadata request (API key 3, version 4) that must list at least
``--brokers`` brokers (default 1; a cluster's broker lists only brokers that are
registered and unfenced). Redis: a PING that must answer PONG. A Redis Cluster
node: ``cluster_state:ok`` from its own view, its replication link up if it is a
replica, and with ``--replicas R`` every primary that holds slots has R replicas
not marked failed. S3: an unsigned request for a bucket that must be answered as
S3 answers one (403 or 404 with an S3 error document), which the gateway does
once its filer is up. Polls until ready, until the timeout, or until the watched
process exits; never a fixed sleep.

Usage: python3 ready.py kafka|redis|redis-cluster|s3 HOST PORT [--timeout S] [--pid PID]
                        [--brokers N] [--replicas R]
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


def redis_text(host: str, port: int, *command: str, timeout: float = 2.0) -> str:
    """The answer to one Redis command whose reply is a bulk or simple string."""
    request = f"*{len(command)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in command)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request.encode())
        reply = sock.makefile("rb")
        first = reply.readline()
        if first.startswith(b"+"):
            return first[1:].decode().strip()
        if first.startswith(b"$") and int(first[1:]) >= 0:
            return reply.read(int(first[1:])).decode()
        raise ConnectionError(first.decode(errors="replace").strip() or "connection closed")


def redis_cluster_problem(host: str, port: int, replicas: int) -> str | None:
    """Why the cluster node at host:port is not serving yet, or None when it is."""
    info = dict(
        line.split(":", 1)
        for line in redis_text(host, port, "CLUSTER", "INFO").splitlines()
        if ":" in line
    )
    if info.get("cluster_state") != "ok":
        return f"cluster_state is {info.get('cluster_state')}"
    role = redis_text(host, port, "INFO", "replication")
    if "role:slave" in role and "master_link_status:up" not in role:
        return "replica not yet linked to its primary"
    rows = [line.split() for line in redis_text(host, port, "CLUSTER", "NODES").splitlines()]
    failed = [row[1] for row in rows if {"fail", "fail?"} & set(row[2].split(","))]
    if failed:
        return f"nodes marked failed: {', '.join(failed)}"
    for row in rows:
        # id address flags primary-id ping pong epoch link-state [slots...]
        if "master" in row[2].split(",") and len(row) > 8:
            followers = sum(1 for other in rows if other[3] == row[0])
            if followers < replicas:
                return f"primary {row[1]} has {followers} of {replicas} replicas"
    return None


def _alive(pid: int | None) -> bool:
    return pid is None or os.path.exists(f"/proc/{pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("service", choices=["kafka", "redis", "redis-cluster", "s3"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--pid", type=int, default=None, help="give up early if this process exits")
    parser.add_argument("--brokers", type=int, default=1, help="Kafka: brokers the metadata lists")
    parser.add_argument("--replicas", type=int, default=0, help="Redis Cluster: replicas each")
    args = parser.parse_args()

    deadline = time.monotonic() + args.timeout
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if not _alive(args.pid):
            print(f"{args.service} process {args.pid} exited during start-up", file=sys.stderr)
            return 1
        try:
            if args.service == "kafka":
                brokers = kafka_brokers(args.host, args.port)
                if brokers >= args.brokers:
                    return 0
                last_error = f"metadata lists {brokers} of {args.brokers} brokers"
            elif args.service == "s3":
                if s3_answers(args.host, args.port):
                    return 0
                last_error = "the S3 gateway does not answer as S3 yet"
            elif args.service == "redis-cluster":
                problem = redis_cluster_problem(args.host, args.port, args.replicas)
                if problem is None:
                    return 0
                last_error = problem
            elif redis_ping(args.host, args.port):
                return 0
        except (OSError, struct.error) as exc:
            last_error = str(exc) or type(exc).__name__
        time.sleep(0.2)  # poll interval between real checks, not a wait for readiness
    print(f"{args.service} on {args.host}:{args.port} not ready: {last_error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
