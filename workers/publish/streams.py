"""Each generation's text as it is made: events on a Redis Stream per request.

``conveyor:stream:{<request id>}`` (``schemas.stream_key``) holds, in order:

- ``start``: a generation of the request began (``run``: which one, ``attempt``,
  ``worker``). A second ``start`` means the request is generated again (its worker
  was killed, or its partition moved): a reader drops the text of the run before;
  chunks and ends carry their ``run``, so a late write of an old run is told apart;
- ``chunk``: the next piece of text (``text``) of ``run``;
- ``end``: ``run`` finished (``finish_reason``); its result document is written next;
- ``error``: ``run`` stopped without an answer (``code``, ``message``: cancelled,
  expired, the model failed).

The stream is bounded (``XADD MAXLEN ~ stream_maxlen``) and expires ``stream_ttl_s``
after its last event. It is a preview: the result document in the result store is
the answer (first final wins), and is written whether or not the stream could be.
Events are buffered and written by one task, a pipeline per round, in the order
they were made; when Redis fails a round, its events are dropped and counted,
never retried into a later order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import redis.asyncio as aioredis

from common.security import redis_options
from schemas import stream_key
from workers.config.worker import WorkerSettings

log = logging.getLogger(__name__)

Event = tuple[str, dict[str, str]]  # stream key, fields


class TokenStreams:
    """Writes generation events, one pipeline per round of whatever is waiting."""

    @classmethod
    @asynccontextmanager
    async def open(
        cls, settings: WorkerSettings, maxlen: int, ttl_s: int
    ) -> AsyncIterator[TokenStreams]:
        """Streams on the worker's Redis, written until the context ends."""
        url = settings.redis_url.get_secret_value()
        options = {"socket_timeout": 5, "socket_connect_timeout": 5, **redis_options(settings)}
        client = aioredis.Redis.from_url(url, **options)
        streams = cls(client, settings.worker_id, maxlen, ttl_s)
        try:
            yield streams
        finally:
            await streams.aclose()
            await client.aclose()

    def __init__(self, client: aioredis.Redis, worker: str, maxlen: int, ttl_s: int) -> None:
        self.client = client
        """Also the generation stage's, to look for cancellations."""
        self._worker = worker
        self._maxlen = maxlen
        self._ttl_s = ttl_s
        self._waiting: list[Event] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self.dropped = 0
        """Events lost to Redis failures (the results are unaffected)."""
        self.written = 0

    def start(self, request_id: str, run: str, attempt: int) -> None:
        self._add(
            request_id,
            {"type": "start", "run": run, "attempt": str(attempt), "worker": self._worker},
        )

    def chunk(self, request_id: str, run: str, text: str) -> None:
        self._add(request_id, {"type": "chunk", "run": run, "text": text})

    def end(self, request_id: str, run: str, finish_reason: str) -> None:
        self._add(request_id, {"type": "end", "run": run, "finish_reason": finish_reason})

    def error(self, request_id: str, run: str, code: str, message: str) -> None:
        self._add(request_id, {"type": "error", "run": run, "code": code, "message": message})

    def _add(self, request_id: str, fields: dict[str, str]) -> None:
        self._waiting.append((stream_key(request_id), fields))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._wake.set()

    async def _write_loop(self) -> None:
        while not self._closing or self._waiting:
            await self._wake.wait()
            events, self._waiting = self._waiting, []
            try:
                if events:
                    await self._write(events)
            finally:
                if not self._waiting:
                    self._wake.clear()

    async def _write(self, events: list[Event]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, fields in events:
            pipe.xadd(key, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]  # redis-py types the fields as a narrower mapping
        for key in dict.fromkeys(key for key, _ in events):
            pipe.expire(key, self._ttl_s)
        try:
            await pipe.execute()
            self.written += len(events)
        except Exception as exc:  # a preview: the results never wait for it
            self.dropped += len(events)
            log.warning("%d stream events dropped: Redis failed (%r)", len(events), exc)

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            with suppress(Exception):
                await asyncio.wait_for(self._writer, 5.0)
            if not self._writer.done():
                self._writer.cancel()
