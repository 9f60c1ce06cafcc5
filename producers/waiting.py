"""Waiting for results without polling: the one algorithm both result readers share.

A worker writes a result with ``SET conveyor:result:<id> ... NX`` and then
announces it on a channel named after the key (``PUBLISH``; ``SPUBLISH`` on a
Redis Cluster). Waiting is

1. subscribe to the keys' channels and wait until Redis confirms every subscription,
2. read the keys, yielding what is already there,
3. on each announcement, read the announced keys again.

The order matters: a result written after step 1 is announced to the subscriber, and one
written before it is found in step 2, so none is ever missed. Reading before
subscribing would lose a result that lands between the two.

``wait_for_results`` is that loop; a ``Subscription`` is how one reader does the
steps: ``producers.results`` (one standalone Redis, every wait of a client on
one shared pub/sub connection) and ``producers.cluster_results`` (sharded
channels on the primaries of a Redis Cluster).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Collection, Iterable, Sequence
from typing import Protocol

from producers.errors import ResultTimeout
from schemas import Result, decode_result, result_key


class Subscription(Protocol):
    """The channels of one wait, and reads of their keys; each method raises the
    reader's ``ServiceUnavailable`` when Redis cannot be reached."""

    async def subscribe(self, keys: Sequence[str]) -> None:
        """Subscribe to the channels of ``keys``; return once Redis confirmed each one."""

    async def read(self, keys: Collection[str]) -> dict[str, bytes]:
        """The values of ``keys`` that exist now, read where announcements will come from."""

    async def next(self, pending: Collection[str], deadline: float) -> Collection[str] | None:
        """Pending keys to read now: those announced since the last call, and any whose
        subscription had to be made again (a lost connection, a moved slot). Waits
        until ``deadline`` (``time.monotonic()``) for one; None once it passed."""

    async def aclose(self) -> None:
        """Give the subscriptions back, however the wait ended."""


async def wait_for_results(
    subscription: Subscription,
    request_ids: Iterable[str],
    timeout: float,  # noqa: ASYNC109 - expiry must raise ResultTimeout naming the ids
) -> AsyncGenerator[Result, None]:
    """Yield each request's result as it becomes available, in completion order.

    Raises ``ResultTimeout`` naming the ids still pending after ``timeout``
    seconds. Ids given twice are waited for once. ``subscription`` is closed at
    the end, however the wait ends (result, timeout, error, cancellation).
    """
    try:
        pending = {result_key(i): i for i in dict.fromkeys(request_ids)}
        if not pending:
            return
        deadline = time.monotonic() + timeout
        await subscription.subscribe(list(pending))
        to_read: Collection[str] | None = list(pending)
        while to_read is not None:
            values = await subscription.read(to_read)
            raise_if_cancelled()
            for key, raw in values.items():
                if key in pending:
                    del pending[key]
                    yield decode_result(raw)
            if not pending:
                return
            to_read = await subscription.next(pending, deadline)
        raise ResultTimeout(list(pending.values()), timeout)
    finally:
        await subscription.aclose()


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was asked to stop and is still going.

    Python 3.11's ``asyncio.wait_for`` returns its result when the cancellation
    races with completion, swallowing it; redis-py sends every command through one.
    A wait that went on after that would run until its timeout, so each step
    checks the request (``Task.cancelling``) left behind.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
