"""Cores for each part of an end-to-end run, and how busy each group of them was.

With ``--pin``, the broker and Redis run on the last cores, the producers before them
and the workers on the rest (every thread of a process pinned); ``/proc/stat`` read
twice gives each group's busy share between the two readings.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def _pin_services(args: argparse.Namespace) -> None:
    """Broker and Redis on the last cores, so workers and producers do not share them."""
    if not args.pin:
        return
    cores = _service_cores(args)
    for pidfile in (Path(".run").glob("kafka-*/kafka.pid"), Path(".run").glob("redis-*/redis.pid")):
        for path in pidfile:
            pid = int(path.read_text())
            if not Path(f"/proc/{pid}").exists():
                raise SystemExit(
                    f"--pin: {path} names pid {pid}, which is not running (a service stopped "
                    "under the run?): compose/local/down.sh, then run again"
                )
            _pin_all_threads(pid, cores)
    print(f"  broker and Redis pinned to cores {sorted(cores)}", flush=True)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _core_times() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) clock ticks so far, from ``/proc/stat``; empty off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(field) for field in fields[:8]]
            idle = ticks[3] + ticks[4]  # idle and waiting for I/O
            times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def _cores_busy(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], args: argparse.Namespace
) -> dict[str, float]:
    """Busy share (%) of each group of cores between two ``_core_times``: with ``--pin``
    the services', the producers' and the workers' cores, else all of them."""
    groups = (
        {
            "services": _service_cores(args),
            "producers": _producer_cores(args),
            "workers": _worker_cores(args),
        }
        if args.pin
        else {"all": set(_cores())}
    )
    shares = {}
    for name, cores in groups.items():
        common = [c for c in cores if c in before and c in after]
        busy = sum(after[c][0] - before[c][0] for c in common)
        total = sum(after[c][1] - before[c][1] for c in common)
        shares[name] = 100.0 * busy / total if total else math.nan
    return shares


def _service_cores(args: argparse.Namespace) -> set[int]:
    """``--service-cores`` of the last cores; by default a quarter of them, at least two
    (with two of 16, at 9,600 requests a second, the parts of the p99 that wait on the
    broker and Redis were 2.5 and 3.5 times those with four: docs/benchmarks.md)."""
    cores = _cores()
    return set(cores[-(args.service_cores or max(2, len(cores) // 4)) :])


def _producer_cores(args: argparse.Namespace) -> set[int]:
    """``--producer-cores`` before the services'; by default a quarter of the cores, at
    least two: sending 150 KB records fast enough to keep a GPU fed takes several
    processes."""
    cores = _cores()
    services = len(_service_cores(args))
    count = args.producer_cores or max(2, len(cores) // 4)
    return set(cores[-services - count : -services])


def _worker_cores(args: argparse.Namespace) -> set[int]:
    return set(_cores()) - _service_cores(args) - _producer_cores(args)


def _pin_all_threads(pid: int, cores: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:
            continue  # a thread that ended meanwhile
