"""An NVIDIA MPS server for the host's worker processes, started and stopped by the supervisor.

Without MPS the processes on one card take turns on it (time slices): one process's
decode kernels never run beside another's forward, and eight processes reach what
one would. Under MPS one server runs every client's kernels in one context, and
they overlap (docs/benchmarks.md: four workers on a card, 12,525 img/s without
MPS, 15,721 with).

``--mps auto`` (the default) uses MPS when a card has several processes: an MPS
server already running for this environment (``CUDA_MPS_PIPE_DIRECTORY`` names
its pipes, or the system's default ``/tmp/nvidia-mps`` has them: an operator's
daemon, or Kubernetes' device plugin with ``sharing.mps``) is used as it is;
otherwise the supervisor starts a control daemon of its own, with pipe and log
folders of its own (so it never touches another user's server), gives its
folders to the worker processes and quits it when they are gone. Where MPS
cannot start (no ``nvidia-cuda-mps-control``, or the daemon refuses), ``auto``
says why in one line and runs without it; ``--mps on`` stops instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
SYSTEM_PIPES = Path("/tmp/nvidia-mps")
CONTROL = "nvidia-cuda-mps-control"
_TIMEOUT_S = 30.0


class MpsUnavailable(RuntimeError):
    """MPS was asked for (``--mps on``) and cannot run here; the message says why."""


def running_server() -> Path | None:
    """The pipe folder of an MPS control daemon this environment already uses, if any."""
    named = os.environ.get(PIPE_VARIABLE)
    for folder in ([Path(named)] if named else []) + [SYSTEM_PIPES]:
        if (folder / "control").exists():
            return folder
    return None


class MpsServer:
    """A control daemon of the supervisor's own; ``env`` is what its clients need."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {PIPE_VARIABLE: str(root / "pipe"), LOG_VARIABLE: str(root / "log")}
        self._control = shutil.which(CONTROL)

    @classmethod
    def start(cls) -> MpsServer:
        """Start a daemon in fresh folders. Raises ``MpsUnavailable`` saying why it cannot."""
        if shutil.which(CONTROL) is None:
            raise MpsUnavailable(f"{CONTROL} is not on PATH (it comes with NVIDIA's driver)")
        server = cls(Path(tempfile.mkdtemp(prefix="conveyor-mps-")))
        for path in server.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                [str(server._control), "-d"],
                env=os.environ | server.env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_TIMEOUT_S,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            shutil.rmtree(server.root, ignore_errors=True)  # nothing started: nothing to inspect
            raise MpsUnavailable(f"{CONTROL} -d failed: {_why(exc)}") from exc
        log.info("MPS control daemon started (pipes and logs in %s)", server.root)
        return server

    def stop(self) -> None:
        """Quit the daemon (it stops its servers); its log folder stays for inspection."""
        if self._control is None:
            return
        try:
            subprocess.run(
                [self._control],
                input=b"quit\n",
                env=os.environ | self.env,
                capture_output=True,
                timeout=_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("stopping the MPS control daemon failed: %s", _why(exc))
            return
        log.info("MPS control daemon stopped (logs in %s)", self.root / "log")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's and the daemon's logs, for a message."""
        found = []
        for name in ("server.log", "control.log"):
            path = self.root / "log" / name
            if path.exists():
                found += path.read_text(errors="replace").splitlines()[-lines:]
        return " | ".join(found)


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        output = (exc.stderr or exc.stdout or b"").decode(errors="replace").strip()
        return f"status {exc.returncode}" + (f": {output}" if output else "")
    return str(exc) or type(exc).__name__
