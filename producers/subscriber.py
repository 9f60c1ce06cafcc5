"""One pub/sub connection for every wait of a client: channels multiplexed to listeners.

A wait on a standalone Redis (``producers.results``) registers a ``Listener`` for
the channels of its keys. ``SharedSubscriber`` subscribes each channel once, however
many waits want it, and unsubscribes it when the last of them leaves; one task
reads the connection and hands each announcement to the listeners of its channel.
Thousands of concurrent waits thus hold one connection, not one each.

Commands go out in the order they were asked for: ``add`` and ``remove`` queue
them at once, and whoever holds the send lock next sends the whole queue. So an
``UNSUBSCRIBE`` of a channel and a later ``SUBSCRIBE`` of it reach Redis in that
order, and Redis confirms each ``SUBSCRIBE`` in the order sent: the n-th
confirmation of a channel answers the n-th subscription queued for it, and a wait
returns from ``add`` only once its own subscription (not an earlier one about to
be undone) is confirmed.

The connection is never opened again: redis-py would reconnect (and subscribe
again) in silence, and whatever was announced in between would be lost. Instead
a failed connection fails the subscriber: every listener is told
(``Listener.lost``), subscribes again on a new one and reads its keys again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

_CHUNK = 500  # channels per SUBSCRIBE or UNSUBSCRIBE: one round trip each, none huge

Verb = Literal["SUBSCRIBE", "UNSUBSCRIBE"]


class SubscriptionLost(RedisConnectionError):
    """The shared pub/sub connection failed: subscribe again on a new one."""


class Listener:
    """What one wait learns from the shared connection: announced channels, or a loss."""

    def __init__(self) -> None:
        self.notified: set[str] = set()
        self.lost = False
        self._event = asyncio.Event()

    def notify(self, channel: str) -> None:
        self.notified.add(channel)
        self._event.set()

    def lose(self) -> None:
        self.lost = True
        self._event.set()

    async def wait(self) -> None:
        """Return once something was announced or the connection was lost."""
        if not (self.notified or self.lost):
            self._event.clear()
            await self._event.wait()


class SharedSubscriber:
    """Subscriptions of many waits on one pub/sub connection of ``client``.

    ``client`` is this subscriber's own (retries off, see the module docstring); it
    is closed with the subscriber.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._pubsub = client.pubsub()
        self._listeners: dict[str, set[Listener]] = {}
        # Per channel, one future per SUBSCRIBE sent or queued, oldest first.
        self._confirmations: dict[str, deque[asyncio.Future[None]]] = {}
        self._queue: list[tuple[Verb, str]] = []
        self._sending = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self.failure: str | None = None
        """Why the connection failed (None while it works); a failed subscriber stays so."""

    @property
    def channels(self) -> int:
        """Channels subscribed now (or about to be), for tests and metrics."""
        return len(self._listeners)

    async def add(self, listener: Listener, channels: Sequence[str]) -> None:
        """Subscribe ``listener`` to ``channels``; return once Redis confirmed each one.

        Announcements reach ``listener`` from this call on, confirmed or not. Raises
        ``SubscriptionLost`` when the connection failed (then or meanwhile), and the
        client's errors when it cannot be reached.
        """
        self._check()
        awaited: list[asyncio.Future[None]] = []
        loop = asyncio.get_running_loop()
        for channel in channels:
            listeners = self._listeners.get(channel)
            if listeners is None:
                listeners = self._listeners[channel] = set()
                future: asyncio.Future[None] = loop.create_future()
                self._confirmations.setdefault(channel, deque()).append(future)
                self._queue.append(("SUBSCRIBE", channel))
            listeners.add(listener)
            pending = self._confirmations.get(channel)
            if pending:
                awaited.append(pending[-1])
        await self._flush()
        if awaited:
            # asyncio.wait, not gather: a wait cancelled here must not cancel the
            # futures other waits share.
            await asyncio.wait(awaited)
        self._check()

    async def remove(self, listener: Listener, channels: Iterable[str]) -> None:
        """``listener`` leaves ``channels``; a channel no one listens to is unsubscribed."""
        for channel in channels:
            listeners = self._listeners.get(channel)
            if listeners is None:
                continue
            listeners.discard(listener)
            if not listeners:
                del self._listeners[channel]
                self._queue.append(("UNSUBSCRIBE", channel))
        if self.failure is None:
            # A connection that fails now fails the subscriber; the wait leaving does not care.
            with contextlib.suppress(Exception):
                await self._flush()

    async def aclose(self) -> None:
        """Stop reading, close the connection, and tell every listener it is lost."""
        self._fail("the client was closed")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
        await self._client.aclose()

    def _check(self) -> None:
        if self.failure is not None:
            raise SubscriptionLost(self.failure)

    async def _flush(self) -> None:
        """Send every queued command, in order, merged into commands of up to ``_CHUNK``.

        Raises the client's error when the first connection cannot be made, and
        ``SubscriptionLost`` when a connection that worked fails.
        """
        async with self._sending:
            self._check()
            if not self._queue:
                return
            queue, self._queue = self._queue, []
            try:
                if self._reader is not None and not self._connected():
                    raise RedisConnectionError("the connection was closed")
                for verb, channels in _commands(queue):
                    await self._pubsub.execute_command(verb, *channels)
            except BaseException as exc:
                # Cancelled or failed halfway: what Redis got is unknown, so no
                # subscription of this connection can be trusted any more.
                self._fail(f"sending {queue[0][0]} failed: {exc or type(exc).__name__}")
                if self._reader is None or not isinstance(exc, Exception):
                    raise
                raise SubscriptionLost(self.failure) from exc
            if self._reader is None:  # connected now, so it can be read
                self._reader = asyncio.create_task(self._read(), name="conveyor-subscriber")

    async def _read(self) -> None:
        try:
            # A connection redis-py finds closed would be opened again, in silence:
            # stop at the first sign of that instead.
            while self.failure is None and self._connected():
                message = await self._pubsub.get_message(timeout=None)
                if message is not None:
                    self._take(message)
        except asyncio.CancelledError:
            raise
        # Any error: a closed socket surfaces as RedisError, OSError or (uvloop) RuntimeError.
        except Exception as exc:
            self._fail(f"the connection failed: {exc or type(exc).__name__}")
        self._fail("the connection was closed")

    def _connected(self) -> bool:
        connection = self._pubsub.connection
        return connection is not None and bool(connection.is_connected)

    def _take(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        channel = _text(message["channel"])
        if kind == "message":
            for listener in self._listeners.get(channel, ()):
                listener.notify(channel)
        elif kind == "subscribe":
            pending = self._confirmations.get(channel)
            if pending:
                future = pending.popleft()
                if not pending:
                    del self._confirmations[channel]
                if not future.done():
                    future.set_result(None)

    def _fail(self, why: str) -> None:
        if self.failure is not None:
            return
        self.failure = why
        for pending in self._confirmations.values():
            for future in pending:
                if not future.done():
                    future.set_result(None)  # add() then sees the failure
        self._confirmations.clear()
        for listeners in self._listeners.values():
            for listener in listeners:
                listener.lose()


def _commands(queue: list[tuple[Verb, str]]) -> list[tuple[Verb, list[str]]]:
    """Consecutive commands of one verb merged, at most ``_CHUNK`` channels each."""
    commands: list[tuple[Verb, list[str]]] = []
    for verb, channel in queue:
        if commands and commands[-1][0] == verb and len(commands[-1][1]) < _CHUNK:
            commands[-1][1].append(channel)
        else:
            commands.append((verb, [channel]))
    return commands


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
