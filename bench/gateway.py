"""The HTTP gateway's cost: requests/s and latency through ``conveyor gateway`` against
the SDK's own ``submit`` and ``wait``, to the same digits worker, in one run.

``python -m bench.gateway [--requests 400] [--concurrency 8] [--repeats 3]`` starts one
digits worker (``--model digits``) and one gateway on loopback, then takes turns within
each repeat: ``--concurrency`` callers in a closed loop each send their share of
``--requests`` held-out digit PNGs, one request per call, and wait for each answer,

- ``sdk``: ``AsyncClient.submit`` then ``AsyncClient.wait`` (one client for all);
- ``gateway``: an infer call (binary tensor data, tritonclient's layout) over a
  keep-alive HTTP/1.1 connection per caller, answered by the gateway.

Each call's time runs from the call to its answer. It prints requests/s, p50 and p99
of each (medians over the repeats) and the gateway's added p99, and writes
``gateway-bench.json`` into ``--out``. On a small machine the worker, the gateway, Kafka,
Redis and this process share the cores: read the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from bench.stats import percentile
from demo.models.digits import build_digits_model, default_model_path, heldout_digits
from producers.admin import create_model_topics, delete_model_topics
from producers.client import AsyncClient
from producers.settings import ClientSettings
from producers.testing import WorkerConfig, WorkerProcess
from producers.testing.gateway import GatewayProcess

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = 2


class HttpCaller:
    """One keep-alive HTTP/1.1 connection that posts infer calls: the least a client does."""

    def __init__(self, port: int, model: str) -> None:
        self._port = port
        self._path = f"/v2/models/{model}/infer"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def infer(self, png: bytes) -> dict[str, Any]:
        answer = await self._call(png)
        if answer is None:  # the server closed the idle connection (its keep-alive): again
            await self.close()
            answer = await self._call(png)
        if answer is None:
            raise RuntimeError("the gateway closed a fresh connection without answering")
        return answer

    async def _call(self, png: bytes) -> dict[str, Any] | None:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self._port)
        tensor = struct.pack("<I", len(png)) + png
        head = json.dumps(
            {
                "inputs": [
                    {
                        "name": "INPUT",
                        "datatype": "BYTES",
                        "shape": [1],
                        "parameters": {"binary_data_size": len(tensor)},
                    }
                ],
                "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": False}}],
            }
        ).encode()
        body = head + tensor
        self._writer.write(
            f"POST {self._path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n\r\n".encode()
            + body
        )
        status_line = await self._reader.readline()
        if not status_line:
            return None
        length = 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        answer: dict[str, Any] = json.loads(await self._reader.readexactly(length))
        if b" 200 " not in status_line:
            raise RuntimeError(f"the gateway answered {status_line!r}: {answer}")
        return answer

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _closed_loop(
    calls: Sequence[Callable[[bytes], Awaitable[object]]], pngs: Sequence[bytes], total: int
) -> tuple[float, list[float]]:
    """(requests/s, each call's ms): ``len(calls)`` callers share ``total`` calls."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def caller(call: Callable[[bytes], Awaitable[object]]) -> None:
        for n in counter:
            started = time.perf_counter()
            await call(pngs[n % len(pngs)])
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in calls))
    return total / (time.perf_counter() - started), latencies


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap, redis_url=args.redis_url)
    model = f"gwbench{uuid.uuid4().hex[:8]}"
    build_digits_model(default_model_path())
    pngs = [png for png, _digit in heldout_digits()]
    await create_model_topics(settings, model, PARTITIONS)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config = WorkerConfig(
        model, args.kafka_bootstrap, args.redis_url, options=("--decode-threads", "1")
    )
    worker = WorkerProcess(config, args.log_dir / f"{model}-worker.log").start()
    gateway = GatewayProcess(
        args.kafka_bootstrap,
        args.redis_url,
        args.log_dir / f"{model}-gateway.log",
        options=("--max-lag", "none"),
    ).start()
    try:
        await worker.until_ready()
        await gateway.until_ready()
        return await _measure(settings, model, pngs, gateway.port, args)
    finally:
        gateway.stop()
        await worker.aclose()
        await delete_model_topics(settings, model)


async def _measure(
    settings: ClientSettings, model: str, pngs: list[bytes], port: int, args: argparse.Namespace
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"sdk": [], "gateway": []}
    async with AsyncClient(settings) as sdk:

        async def sdk_call(png: bytes) -> object:
            return await sdk.wait(await sdk.submit(png, model=model), timeout=60)

        http = [HttpCaller(port, model) for _ in range(args.concurrency)]
        variants: dict[str, list[Callable[[bytes], Awaitable[object]]]] = {
            "sdk": [sdk_call] * args.concurrency,
            "gateway": [caller.infer for caller in http],
        }
        try:
            for calls in variants.values():  # warm-up: connections, topic metadata
                await _closed_loop(calls, pngs, 2 * args.concurrency)
            for repeat in range(args.repeats):
                for name, calls in variants.items():
                    rate, latencies = await _closed_loop(calls, pngs, args.requests)
                    runs[name].append(
                        {
                            "requests_s": rate,
                            "p50_ms": percentile(latencies, 50),
                            "p99_ms": percentile(latencies, 99),
                        }
                    )
                    print(f"[bench] repeat {repeat + 1} {name}: {runs[name][-1]}", flush=True)
        finally:
            for caller in http:
                await caller.close()
    medians = {
        name: {key: statistics.median(r[key] for r in found) for key in found[0]}
        for name, found in runs.items()
    }
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "median": medians,
        "gateway_added_p99_ms": medians["gateway"]["p99_ms"] - medians["sdk"]["p99_ms"],
        "gateway_rate_ratio": medians["gateway"]["requests_s"] / medians["sdk"]["requests_s"],
        "runs": runs,
    }


def _table(report: dict[str, Any]) -> str:
    lines = ["path     requests/s   p50 ms   p99 ms"]
    for name, found in report["median"].items():
        rate, p50, p99 = found["requests_s"], found["p50_ms"], found["p99_ms"]
        lines.append(f"{name:<8} {rate:>10.0f} {p50:>8.2f} {p99:>8.2f}")
    lines.append(
        f"gateway: {report['gateway_rate_ratio']:.2f}x the SDK's rate, "
        f"p99 +{report['gateway_added_p99_ms']:.2f} ms"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="calls per variant and repeat")
    parser.add_argument("--concurrency", type=int, default=8, help="callers at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".run" / "bench")
    args = parser.parse_args(argv)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    report = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
