"""How fetch responses reach memory: one copy per frame, into memory the process keeps.

A fetch response of large records (camera frames, 150 KB each) is several
megabytes. Read the stock way it cost the worker's event loop most of its time
(py-spy, ``docs/benchmarks.md``), all of it copying and faulting in memory:

- asyncio's ``StreamReader`` appends every received chunk to one ``bytearray``
  and ``readexactly`` copies the frame out of it twice (a slice, then ``bytes``).
  ``FrameReader`` keeps the chunks as they came and joins a frame once, when it
  is complete; its reader is woken once per frame instead of once per chunk.
- Frame-sized buffers above glibc's ``mmap`` threshold are mapped fresh for each
  frame and every page faults in again; buffers below it are handed back to the
  kernel when the top of the heap passes the trim threshold. ``keep_large_buffers``
  sets both so that a fetch response (``MAX_FETCH_BYTES``) and its copies reuse
  memory the process already has, while decoded images, which Pillow allocates in
  blocks of ``IMAGE_BLOCK_BYTES``, stay above the threshold and go back to the
  system when freed.

``install()`` puts both in place for every aiokafka connection of the process.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
import types
from collections import deque
from collections.abc import Iterable
from typing import Any, Final, SupportsIndex

import aiokafka.conn as _conn
from PIL import _imaging

__all__ = [
    "IMAGE_BLOCK_BYTES",
    "MAX_FETCH_BYTES",
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "FrameReader",
    "install",
    "keep_large_buffers",
    "set_allocator",
]

log = logging.getLogger(__name__)

MAX_FETCH_BYTES: Final = 16 << 20
"""The consumer's ``fetch_max_bytes`` and ``max_partition_fetch_bytes``. Kafka returns a
larger first batch anyway, so a record of any allowed size still arrives. Responses of
this size come from the heap (``keep_large_buffers``). A response is what one round trip
to the broker brings: on an H100 host 4 MiB ones (28 camera frames) held a GPU worker to
0.73x of its rate with 16 MiB ones (``docs/benchmarks.md``)."""

MMAP_THRESHOLD: Final = 17 << 20
"""Allocations from this size up are mapped, and unmapped when freed: above a fetch
response, below Pillow's image blocks (``IMAGE_BLOCK_BYTES``). Decode threads allocate
from heaps of their own (glibc arenas); were image blocks served from them, each thread
would keep the largest image it ever decoded (``docs/reliability.md``)."""

TRIM_THRESHOLD: Final = 48 << 20
"""Free memory each heap keeps at its top: a fetch response, its records and copies."""

IMAGE_BLOCK_BYTES: Final = 32 << 20
"""Pillow's block size (its default is 16 MiB): a large image is allocated in blocks of
this size, each above ``MMAP_THRESHOLD``."""

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3


class FrameReader(asyncio.StreamReader):
    """A ``StreamReader`` for length-prefixed frames, as aiokafka's connection reads them.

    It is a ``StreamReader`` for the protocol and writer that expect one, and keeps
    all of its state itself. Only ``readexactly`` and ``at_eof`` read (all aiokafka
    calls); the other read methods raise ``NotImplementedError``. Flow control is
    ``StreamReader``'s: reading pauses past twice the limit, or past the frame the
    reader waits for when that is larger, and resumes when the reader wants more.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self._frame_loop = loop
        self._high_water = 2 * limit
        self._chunks: deque[bytes] = deque()
        self._head = 0  # bytes of chunks[0] already handed out
        self._queued = 0  # bytes received and not handed out
        self._wanted = 0  # bytes the waiting reader needs; 0 when none waits
        self._waiting: asyncio.Future[None] | None = None
        self._reading: asyncio.BaseTransport | None = None  # None: cannot be paused
        self._is_paused = False
        self._ended = False
        self._error: Exception | None = None

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        self._reading = transport

    def exception(self) -> Exception | None:
        return self._error

    def set_exception(self, exc: Exception) -> None:
        self._error = exc
        self._wake(exc)

    def feed_eof(self) -> None:
        self._ended = True
        self._wake()

    def at_eof(self) -> bool:
        return self._ended and not self._queued

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if not data:
            return
        chunk = bytes(data)  # transports hand over bytes, and bytes() of bytes is free
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if self._queued >= self._wanted:
            self._wake()
        if self._queued > max(self._high_water, self._wanted):
            self._pause()

    async def readexactly(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if self._error is not None:
            raise self._error
        while self._queued < n:
            if self._ended:
                raise asyncio.IncompleteReadError(self._take(self._queued), n)
            await self._wait(n)
        data = self._take(n)
        if self._queued <= self._high_water // 2:
            self._resume()
        return data

    async def _wait(self, n: int) -> None:
        if self._waiting is not None:
            raise RuntimeError("readexactly called while another coroutine is waiting")
        self._resume()
        self._wanted = n
        self._waiting = self._frame_loop.create_future()
        try:
            await self._waiting
        finally:
            self._waiting = None
            self._wanted = 0
        if self._error is not None:
            raise self._error

    def _wake(self, exc: BaseException | None = None) -> None:
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            if exc is None:
                waiting.set_result(None)
            else:
                waiting.set_exception(exc)

    def _pause(self) -> None:
        if self._reading is None or self._is_paused:
            return
        try:
            self._reading.pause_reading()  # type: ignore[attr-defined]
        except NotImplementedError:  # as StreamReader: buffer everything instead
            self._reading = None
        else:
            self._is_paused = True

    def _resume(self) -> None:
        if self._is_paused and self._reading is not None:
            self._is_paused = False
            self._reading.resume_reading()  # type: ignore[attr-defined]

    def _take(self, n: int) -> bytes:
        """The next ``n`` queued bytes, copied once (not at all when they are one chunk)."""
        chunks = self._chunks
        parts: list[bytes | memoryview] = []
        need = n
        while need:
            chunk, head = chunks[0], self._head
            available = len(chunk) - head
            if available <= need:
                parts.append(chunk if head == 0 else memoryview(chunk)[head:])
                chunks.popleft()
                self._head = 0
                need -= available
            else:
                parts.append(memoryview(chunk)[head : head + need])
                self._head = head + need
                need = 0
        self._queued -= n
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    async def read(self, n: int = -1) -> bytes:
        raise NotImplementedError("FrameReader reads frames: use readexactly")

    async def readline(self) -> bytes:
        raise NotImplementedError("FrameReader reads frames: use readexactly")

    async def readuntil(self, separator: Any = b"\n") -> bytes:
        raise NotImplementedError("FrameReader reads frames: use readexactly")


class _AsyncioWithFrameReader(types.ModuleType):
    """``asyncio`` as aiokafka's connection module sees it: the same, except its
    ``StreamReader`` is ``FrameReader``."""

    StreamReader = FrameReader

    def __getattr__(self, name: str) -> object:
        return getattr(asyncio, name)


def keep_large_buffers() -> bool:
    """Ask glibc's allocator to serve fetch responses from memory it keeps, and decoded
    images from mappings it gives back (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``,
    ``IMAGE_BLOCK_BYTES``).

    Returns False where that cannot be done (not Linux, or not glibc); the worker
    then works as before, with more page faults.
    """
    _imaging.set_block_size(IMAGE_BLOCK_BYTES)
    kept = set_allocator(MMAP_THRESHOLD, TRIM_THRESHOLD)
    if not kept:
        log.info("the C library refused the allocator settings for fetch buffers")
    return kept


def set_allocator(mmap_threshold: int, trim_threshold: int | None = None) -> bool:
    """Set glibc's ``mmap`` threshold (fixed: glibc stops adapting it) and, when given, its
    trim threshold. False where that cannot be done (not Linux, not glibc, refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1)
    if trim_threshold is not None:
        done = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1) and done
    return done


def install() -> None:
    """Read every aiokafka connection of the process with ``FrameReader``, and keep
    large buffers (``keep_large_buffers``). Process-wide and idempotent.

    Raises ``RuntimeError`` if aiokafka's connection module no longer reaches
    ``asyncio`` as a module attribute; ``tests/integration/test_fetch_buffers.py``
    checks that a consumer's connections really read with ``FrameReader``, so an
    upgrade that changes how aiokafka builds its reader fails there.
    """
    current = getattr(_conn, "asyncio", None)
    if isinstance(current, _AsyncioWithFrameReader):
        return
    if current is not asyncio:
        raise RuntimeError(
            "aiokafka.conn no longer reads through the asyncio module; "
            "workers.kafka.fetch_buffers cannot be installed for this aiokafka version"
        )
    keep_large_buffers()
    _conn.asyncio = _AsyncioWithFrameReader("asyncio")
