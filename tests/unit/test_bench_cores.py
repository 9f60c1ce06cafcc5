"""bench.gpu's --pin: a pid file naming a process that is gone is a clear exit."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.gpu.cores import _pin_services


def _dead_pid() -> int:
    pid = 4_194_000  # near the largest pid_max, rarely in use; the loop finds a free one
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


def test_a_stale_broker_pid_file_stops_the_run_with_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    pidfile = tmp_path / ".run" / "kafka-9092" / "kafka.pid"
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text(str(_dead_pid()))
    args = argparse.Namespace(pin=True, service_cores=1, producer_cores=1, producers=1)
    with pytest.raises(SystemExit, match=r"kafka.pid names pid \d+, which is not running"):
        _pin_services(args)
