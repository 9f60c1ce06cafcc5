"""What a thread waiting for the GPU costs, by ``cuda_sync`` mode (``workers.decode.cuda_sync``).

For each mode, in a process of its own (the flag is the device's, set once): the CPU
time a thread spends while it waits ``--wait-ms`` for a kernel (through a plain event,
an event made by ``workers.decode.cuda_sync.event`` as the worker's are, a stream and the
device), as a share of the wait; and the round trip of a tiny kernel and its wait on a
worker's event, the price of sleeping instead of spinning. Needs a GPU.

    python -m bench.cuda_wait --out .run/cuda-wait.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.decode.cuda_sync import SCHEDULE_FLAGS, event, set_cuda_sync


def measure(mode: str, wait_ms: float, round_trips: int) -> dict[str, Any]:
    """This process's waits in ``mode`` on cuda:0."""
    device = torch.device("cuda", 0)
    set_cuda_sync(device, mode)  # type: ignore[arg-type]
    _gpu_sleep(1000)  # the context and the kernel loaded before measuring
    torch.cuda.synchronize()
    cycles = _cycles_per_ms(device) * wait_ms
    row: dict[str, Any] = {"mode": mode}
    waits: dict[str, Callable[[], None]] = {
        "plain_event": lambda: _recorded(torch.cuda.Event()).synchronize(),  # type: ignore[no-untyped-call]
        "event": lambda: _recorded(event()).synchronize(),
        "stream": lambda: torch.cuda.current_stream().synchronize(),
        "device": _device_wait,
    }
    for name, wait in waits.items():
        shares = []
        for _ in range(5):
            _gpu_sleep(int(cycles))
            cpu, wall = time.thread_time(), time.perf_counter()
            wait()
            shares.append((time.thread_time() - cpu) / (time.perf_counter() - wall))
        row[f"{name}_cpu_share"] = statistics.median(shares)
    trips = []
    for _ in range(round_trips):
        start = time.perf_counter()
        _gpu_sleep(1)
        _recorded(event()).synchronize()
        trips.append((time.perf_counter() - start) * 1e6)
    trips.sort()
    row["round_trip_p50_us"] = trips[len(trips) // 2]
    row["round_trip_p99_us"] = trips[int(len(trips) * 0.99)]
    return row


def _gpu_sleep(cycles: int) -> None:
    """A kernel that keeps the GPU busy for ``cycles`` clock cycles."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def _device_wait() -> None:
    torch.cuda.synchronize()


def _recorded(recorded: torch.cuda.Event) -> torch.cuda.Event:
    recorded.record()
    return recorded


def _cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
    start.record()
    _gpu_sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / float(start.elapsed_time(end))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="auto,spin,block")
    parser.add_argument("--wait-ms", type=float, default=50.0)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path(".run/cuda-wait.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this mode
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.wait_ms, args.round_trips)))
        return
    rows = []
    for mode in args.modes.split(","):
        if mode not in SCHEDULE_FLAGS:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(SCHEDULE_FLAGS)}")
        child = [sys.executable, "-m", "bench.cuda_wait", "--one", mode]
        child += ["--wait-ms", str(args.wait_ms), "--round-trips", str(args.round_trips)]
        done = subprocess.run(child, check=True, capture_output=True, text=True)
        if "not applied" in done.stderr:  # set_cuda_sync's warning: the row is not the mode
            sys.exit(f"mode {mode} could not be set:\n{done.stderr}")
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(rows[-1], flush=True)
    report = {"device": torch.cuda.get_device_name(0), "wait_ms": args.wait_ms, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
