"""Synchronous twins of the SDK's asyncio classes: one event loop on a private thread.

``Client`` (of ``AsyncClient``) and ``StreamReader`` (of ``AsyncStreamReader``)
each hold their async twin and a ``LoopThread`` that runs it, so one object may
serve several threads and blocking calls never need a running loop of the
caller's. ``blocking`` and ``blocking_iter`` make a sync method out of the twin's
async one, with its signature and docstring, so a method is written (and
documented) once:

    class Client(SyncTwin[AsyncClient]):
        submit = blocking(AsyncClient.submit)

Interrupting a call (Ctrl-C) cancels it on the loop, which gives back what it held.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

A = TypeVar("A")
P = ParamSpec("P")
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own until ``close()``."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its outcome (from any other thread)."""
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("this client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: cancel the coroutine so it lets go of
            # its connections; cancelling a finished one does nothing.
            future.cancel()
            raise

    def iterate(self, iterator: AsyncGenerator[T, None]) -> Iterator[T]:
        """``iterator``'s items, each fetched on the loop; leaving early closes it there."""
        try:
            while True:
                try:
                    yield self.call(_next(iterator))
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():  # not closed already: end the wait on its loop
                self.call(iterator.aclose())

    def close(self, last: Coroutine[Any, Any, object] | None = None) -> None:
        """End unfinished async generators, run ``last`` (a twin's own close), stop the thread."""
        if self._loop.is_closed():
            if last is not None:
                last.close()
            return
        try:
            # Waits left unfinished (a generator not iterated to its end) end first, each
            # giving back what it holds, before the twin closes the rest.
            self.call(self._loop.shutdown_asyncgens())
            if last is not None:
                self.call(last)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


async def _next(iterator: AsyncGenerator[T, None]) -> T:
    # A coroutine around anext(): run_coroutine_threadsafe takes coroutines only.
    return await anext(iterator)


class SyncTwin(Generic[A]):
    """Base of a synchronous twin: ``_twin``, the async object, runs on ``_loop``."""

    _twin: A
    _loop: LoopThread


def blocking(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SyncTwin[A], P], T]:
    """The sync method of a twin for ``method``, an ``async def`` of the async class."""

    def call(self: SyncTwin[A], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._loop.call(method(self._twin, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


def blocking_iter(
    method: Callable[Concatenate[A, P], AsyncGenerator[T, None]], doc: str | None = None
) -> Callable[Concatenate[SyncTwin[A], P], Iterator[T]]:
    """The sync method of a twin for ``method``, which returns an async generator: an
    iterator whose items are fetched on the loop. ``doc`` replaces the docstring."""

    def call(self: SyncTwin[A], /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        yield from self._loop.iterate(method(self._twin, *args, **kwargs))

    functools.update_wrapper(call, method)
    if doc is not None:
        call.__doc__ = doc
    return call
