"""The host's fork server (``workers.fleet.forkserver``): real processes, forked after the
imports, each with its own arguments, environment, session, output and status."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from workers.fleet.children import Child
from workers.fleet.forkserver import ForkServer
from workers.fleet.plan import Slot

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tests.forkserver_child"


def server_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


async def output(reader: asyncio.StreamReader | None) -> str:
    assert reader is not None
    return (await asyncio.wait_for(reader.read(), 20)).decode()


async def test_a_forked_process_runs_the_module_with_its_own_arguments_env_and_status() -> None:
    forks = await ForkServer.start(["colorsys"], server_env(FORKSERVER_TEST_VALUE="server's"))
    try:
        assert await forks.ready(), forks.reason
        child = await forks.launch(CHILD, ["3"], server_env(FORKSERVER_TEST_VALUE="its own"))
        text = await output(child.stdout)
        assert await asyncio.wait_for(child.wait(), 20) == 3
        assert "args=['3'] value=its own" in text
        assert "session=True preloaded=True" in text  # its own session; imported before
        again = await forks.launch(CHILD, ["0"], server_env())
        assert "value=None" in await output(again.stdout)  # the first child's env did not stay
        assert await again.wait() == 0
    finally:
        await forks.close()


async def test_a_signal_ends_a_forked_process_with_its_status() -> None:
    forks = await ForkServer.start([], server_env())
    try:
        assert await forks.ready()
        child = await forks.launch(CHILD, ["wait"], server_env())
        assert child.stdout is not None
        assert b"args=['wait']" in await asyncio.wait_for(child.stdout.readline(), 20)
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 20) == -signal.SIGTERM
    finally:
        await forks.close()


async def test_when_the_server_dies_its_processes_get_sigterm_and_end() -> None:
    forks = await ForkServer.start([], server_env())
    child = await forks.launch(CHILD, ["wait"], server_env())
    assert child.stdout is not None
    await asyncio.wait_for(child.stdout.readline(), 20)
    os.kill(forks.pid, signal.SIGKILL)
    assert await asyncio.wait_for(child.wait(), 20) == -signal.SIGTERM
    assert not forks.serving
    with pytest.raises(OSError, match="does not serve"):
        await forks.launch(CHILD, ["0"], server_env())
    await forks.close()


async def test_a_server_whose_imports_start_a_native_thread_refuses_naming_it() -> None:
    forks = await ForkServer.start(["tests.forkserver_native_thread"], server_env())
    try:
        assert not await forks.ready()
        reason = "importing tests.forkserver_native_thread started threads of the process"
        assert reason in forks.reason
    finally:
        await forks.close()


async def test_numpy_starts_no_thread_pool_in_the_server_so_it_forks_single_threaded() -> None:
    """numpy's OpenBLAS starts a thread a core as it loads, unless told not to: a fork
    beside those threads is what Python warns of (``DeprecationWarning``)."""
    env = server_env()
    env.pop("OPENBLAS_NUM_THREADS", None)
    forks = await ForkServer.start(["numpy", "torch"], env)
    try:
        assert await forks.ready(), forks.reason
    finally:
        await forks.close()


async def test_a_server_whose_imports_start_a_thread_refuses_and_children_start_anew() -> None:
    forks = await ForkServer.start(["tests.forkserver_thread"], server_env())
    try:
        assert not await forks.ready()
        reason = "importing tests.forkserver_thread started Python threads"
        assert f"{reason} (MainThread, left-running)" in forks.reason
        child = Child(Slot(None, 0), "test-0", CHILD, ["5"], server_env(), json=False)
        child.forks = forks
        await child.start()  # as a new process
        assert await asyncio.wait_for(child.wait(), 20) == 5
        assert child.argv == [sys.executable, "-m", CHILD, "5"]
    finally:
        await forks.close()
