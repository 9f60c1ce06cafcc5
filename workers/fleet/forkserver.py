"""The host's fork server: worker processes start with torch already imported.

A worker process spends most of a warm start importing: torch, torchvision (which
loads Dynamo) and Inductor, which loads the compiled packages, take about 12 s of a
17 s start on an H100 host, in every process and at every restart. The supervisor
therefore starts one process that imports them once (``preload``) and then, on
request, forks: each child runs ``python -m workers.cli ...`` as a fresh process would
(``runpy``), with its own environment, session, output pipe and arguments, but skips
the imports.

Forking is safe only before CUDA is initialised (a forked child cannot use a parent's
CUDA context) and while the process has one thread: a fork copies only the thread
that calls it, and a lock another thread held stays locked in the child for ever.
The server checks both after each import and refuses to serve otherwise (naming the
module and the threads), and the supervisor then starts its processes the ordinary
way. Two imports start threads. numpy starts OpenBLAS's pool as it loads: the server runs
with ``OPENBLAS_NUM_THREADS=1``, so numpy's own matrix products run on one thread in
the worker processes (torch's run on its own threads, ``OMP_NUM_THREADS``, started
after the fork). On a GPU host ``torch._inductor.compile_fx`` starts a thread of
CUDA's driver: the server stops at Inductor's cache (``workers.fleet.host.preloaded``)
and each process imports the rest itself.

The protocol, over a ``SOCK_SEQPACKET`` socket pair, one JSON message a packet:

- server → supervisor: ``{"ready": bool, "reason": str, "seconds": float}`` once,
  after the imports; ``{"forked": token, "pid": int}`` for each request;
  ``{"exited": pid, "status": int}`` when a child ends (``-signum`` when a signal
  ended it, as ``asyncio`` reports it);
- supervisor → server: ``{"fork": token, "module": str, "args": [...], "env": {...}}``
  with the write end of the child's output pipe attached (``SCM_RIGHTS``).

The server ends when the supervisor closes its end (or dies: the server has the
kernel send it SIGTERM then, as every child of the supervisor has); its children then
get SIGTERM the same way, and drain.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib
import itertools
import json
import logging
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("conveyor.fleet")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_NAME = 15
_MAX_MESSAGE = 1 << 20
_CUDA_ERROR_NOT_INITIALIZED = 3
_EXIT_ORPHANED = 70  # the server ended between the fork and the child's first step


def terminate_with_parent() -> None:
    """In a child, before it runs: SIGTERM when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``); nothing where the call does not exist."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prctl(option: int, value: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)


# -- the supervisor's side -------------------------------------------------------------------


class Forked:
    """A worker process the fork server started: what ``asyncio.subprocess.Process``
    offers the supervisor (pid, output, status, signals)."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, pidfd: int | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._ended = asyncio.Event()
        self._pidfd = pidfd

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def ended(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def orphaned(self) -> None:
        """The server is gone before it said how this child ended: the child had SIGTERM
        from the kernel and drains; its status is lost, so it ends as if that signal ended
        it, once it has (its pidfd says so)."""
        if self.returncode is not None:
            return
        if self._pidfd is None:
            self.ended(-signal.SIGTERM)
            return
        loop = asyncio.get_running_loop()
        pidfd = self._pidfd

        def gone() -> None:
            loop.remove_reader(pidfd)
            self.ended(-signal.SIGTERM)

        loop.add_reader(pidfd, gone)


class ForkServer:
    """The supervisor's handle on its fork server (``start``, ``launch``, ``close``)."""

    def __init__(self, process: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self._process = process
        self._sock = sock
        self._ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending: dict[int, asyncio.Future[int | None]] = {}
        self._children: dict[int, Forked] = {}
        self._tokens = itertools.count()
        self._early: dict[int, int] = {}  # children that ended before launch saw their pid
        self._reader = asyncio.create_task(self._read(), name="fork-server")
        self.reason = ""  # why it does not serve, once it does not

    @classmethod
    async def start(cls, preload: Sequence[str], env: Mapping[str, str]) -> ForkServer:
        """A fork server importing ``preload`` (a module it cannot import is skipped),
        in the environment ``env`` (the processes' common one: libraries read some
        variables when they load, such as ``OMP_NUM_THREADS``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # torch.cuda.is_available() asks NVML rather than the CUDA driver, which it would
        # initialise (a module calling it on import would spoil every fork).
        # OpenBLAS's pool would start with numpy's import: the server stays single-threaded.
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OPENBLAS_NUM_THREADS": "1"}
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.fleet.forkserver", str(theirs.fileno()), *preload,
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C reaches the supervisor only
                preexec_fn=terminate_with_parent,
            )  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(process, ours)

    async def ready(self) -> bool:
        """Whether it imported its modules and serves (False, with ``reason``, if not)."""
        return await asyncio.shield(self._ready)

    async def launch(self, module: str, args: Sequence[str], env: Mapping[str, str]) -> Forked:
        """A forked process running ``python -m module *args`` in ``env``. Raises
        ``OSError`` when the server does not serve (``reason`` says why)."""
        if not await self.ready() or not self.serving:
            raise OSError(f"the fork server does not serve: {self.reason}")
        token = next(self._tokens)
        forked: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._pending[token] = forked
        read_end, write_end = os.pipe()
        try:
            request = {"fork": token, "module": module, "args": list(args), "env": dict(env)}
            socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
        except OSError:
            os.close(read_end)
            self._pending.pop(token, None)
            raise
        finally:
            os.close(write_end)
        pid = await forked
        if pid is None:
            os.close(read_end)
            raise OSError(f"the fork server ended: {self.reason}")
        pidfd = _pidfd(pid)
        child = Forked(pid, await _reader(read_end), pidfd)
        self._children[pid] = child
        if pid in self._early:
            child.ended(self._early.pop(pid))
        elif self._reader.done():  # the server ended while the pipe was being wrapped
            child.orphaned()
        return child

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def serving(self) -> bool:
        return self._process.returncode is None and not self._reader.done()

    async def close(self) -> None:
        """End the server (its children should have ended first)."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()
        await self._process.wait()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self._sock, _MAX_MESSAGE):
                self._on(json.loads(data))
        except (OSError, ValueError) as exc:
            self.reason = f"its socket failed: {exc}"
        finally:
            self._lost()

    def _on(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            self.reason = str(message.get("reason", ""))
            if message["ready"]:
                log.info(
                    "fork server ready: worker processes start with torch imported "
                    "(imports took %.1f s)",
                    message.get("seconds", 0.0),
                )
            self._ready.set_result(bool(message["ready"]))
        elif "forked" in message:
            pending = self._pending.pop(int(message["forked"]), None)
            if pending is not None and not pending.done():
                pending.set_result(int(message["pid"]))
        elif "exited" in message:
            pid, status = int(message["exited"]), int(message["status"])
            child = self._children.pop(pid, None)
            if child is not None:
                child.ended(status)
            else:
                self._early[pid] = status

    def _lost(self) -> None:
        self.reason = self.reason or "the fork server exited"
        if not self._ready.done():
            self._ready.set_result(False)
        for pending in self._pending.values():
            if not pending.done():
                pending.set_result(None)
        self._pending.clear()
        for child in self._children.values():
            child.orphaned()
        self._children.clear()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or not Linux ≥ 5.3
        return None


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_MAX_MESSAGE)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


# -- the server ------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """``python -m workers.fleet.forkserver FD MODULE...``: import, check, serve."""
    sock = socket.socket(fileno=int(argv[0]))
    started = time.monotonic()
    reason = preload(argv[1:])
    seconds = time.monotonic() - started
    _send(sock, {"ready": reason is None, "reason": reason or "", "seconds": seconds})
    if reason is None:
        _serve(sock)
    return 0


def preload(modules: Sequence[str]) -> str | None:
    """Import ``modules``; None if a fork is still safe afterwards, else why not."""
    for name in modules:
        with contextlib.suppress(ImportError):  # a child imports what it needs itself
            importlib.import_module(name)
        if _cuda_initialised():
            return f"importing {name} initialised CUDA, which a forked process cannot use"
        if threading.active_count() > 1:
            names = ", ".join(thread.name for thread in threading.enumerate())
            return f"importing {name} started Python threads ({names})"
        threads = _threads()
        if len(threads) > 1:
            return f"importing {name} started threads of the process ({', '.join(threads)})"
    return None


def _threads() -> list[str]:
    """The names of this process's threads (native ones included), where Linux says."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in sorted(tasks):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # ended meanwhile
            continue
    return names


def _cuda_initialised() -> bool:
    """Whether CUDA's driver was initialised in this process (by torch or any other
    library): its ``cuCtxGetCurrent`` answers CUDA_ERROR_NOT_INITIALIZED until then."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as maps:
            loaded = any("libcuda.so" in line for line in maps)
    except OSError:
        return False
    if not loaded:
        return False  # nothing loaded the driver, so nothing initialised it
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    context = ctypes.c_void_p()
    return int(driver.cuCtxGetCurrent(ctypes.byref(context))) != _CUDA_ERROR_NOT_INITIALIZED


def _serve(sock: socket.socket) -> None:
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
    server = os.getpid()
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        _reap(sock)
        if sock.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        if not data:
            return  # the supervisor closed its end: nothing more to start
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _become(request, fds[0], server, (sock.fileno(), wake_read, wake_write))
        for fd in fds:
            os.close(fd)
        _send(sock, {"forked": request["fork"], "pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any], output: int, server: int, inherited: Sequence[int]) -> None:
    """In the forked child: become ``python -m module args`` and exit with its status."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        os.setsid()  # a session of its own, as every worker process has
        terminate_with_parent()
        _prctl(_PR_SET_NAME, b"conveyor-worker")  # for ps and top: its command line is the server's
        if os.getppid() != server:
            os._exit(_EXIT_ORPHANED)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(devnull)
        os.close(output)
        os.environ.clear()
        os.environ.update(request["env"])
        _threads_from_environment()
        sys.argv = [request["module"], *request["args"]]
        # The module may be imported already (by another preloaded one); running it as
        # __main__ anyway is what ``python -m`` would do, so runpy's warning is noise.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exc:
            status = _status(exc.code)
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _threads_from_environment() -> None:
    """torch read ``OMP_NUM_THREADS`` when the server imported it; a child's own value
    (the supervisor's share of the cores) is applied here."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the supervisor is gone: the next read ends the loop
        sock.send(json.dumps(message).encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
