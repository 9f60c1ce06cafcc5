"""A worker as a child process of a demo: started, watched, and drained when the demo ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
_STOP_TIMEOUT_S = 30.0


class DemoError(Exception):
    """The demo could not run to the end; the message says why and where to look."""


class WorkerChild:
    """``conveyor worker --model digits`` as a child process, its output in a log file.

    It runs in a session of its own, so a Ctrl-C at the terminal reaches only
    the demo, which then stops the worker with one SIGTERM: a clean drain.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, cwd: Path = REPO) -> None:
        self._argv = list(argv)
        self.log_path = log_path
        self._cwd = cwd  # its modules are imported from here (a checkout of another version)
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv, stdout=log, stderr=log, cwd=self._cwd, start_new_session=True
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    async def stop(self) -> None:
        """SIGTERM, then wait for the drain; SIGKILL if it takes too long."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            # Shielded: a second Ctrl-C must not leave the worker running unwaited.
            await asyncio.shield(asyncio.wait_for(proc.wait(), _STOP_TIMEOUT_S))
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def unless_it_dies(self, work: Awaitable[T]) -> T:
        """Await ``work``, failing with ``DemoError`` as soon as the worker exits."""
        assert self._proc is not None
        task = asyncio.ensure_future(work)
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, exited):
                pending.cancel()
            # Let a cancelled wait give back its Redis subscription before going on.
            await asyncio.gather(task, exited, return_exceptions=True)
        if task.done() and not task.cancelled():
            return task.result()
        raise DemoError(
            f"the worker exited with status {self._proc.returncode}; its log is {self.log_path}"
        )
