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

On a Redis Cluster (``redis_cluster``) a stream's key is hash-tagged with its request
id, so its events and its expiry go to one primary: a round is a pipeline per primary
(``common.redis_cluster.ClusterRouter``), in the order the events were made. A primary
that answers ``MOVED`` or is lost drops its part of the round, as a failed Redis does;
the router follows the move, or loads the slot map again, for the next round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import redis.asyncio as aioredis
from redis.exceptions import MovedError

from common.cluster_keys import per_key
from common.redis_cluster import ClusterRouter, is_topology_error
from common.security import redis_options
from schemas import cancel_key, stream_key
from workers.config.worker import WorkerSettings

log = logging.getLogger(__name__)

Event = tuple[str, dict[str, str]]  # stream key, fields
TIMEOUT_S = 5.0
"""How long a write or a cancellation check may take Redis (or a cluster, retries included)."""


class TokenStreams:
    """Writes generation events, one pipeline per round of whatever is waiting."""

    @classmethod
    @asynccontextmanager
    async def open(
        cls, settings: WorkerSettings, maxlen: int, ttl_s: int
    ) -> AsyncIterator[TokenStreams]:
        """Streams on the worker's Redis (or Redis Cluster), written until the context ends."""
        url = settings.redis_url.get_secret_value()
        options = {
            "socket_timeout": TIMEOUT_S,
            "socket_connect_timeout": TIMEOUT_S,
            **redis_options(settings),
        }
        store: aioredis.Redis | ClusterRouter
        if settings.redis_cluster:
            store = ClusterRouter(url, options)
        else:
            store = aioredis.Redis.from_url(url, **options)
        streams = cls(store, settings.worker_id, maxlen, ttl_s)
        try:
            yield streams
        finally:
            await streams.aclose()
            await store.aclose()

    def __init__(
        self, store: aioredis.Redis | ClusterRouter, worker: str, maxlen: int, ttl_s: int
    ) -> None:
        """``store``: one Redis, or the router of a Redis Cluster."""
        self._store = store
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
        if isinstance(self._store, aioredis.Redis):
            await self._write_to(self._store, events)
            return
        router = self._store
        try:
            plan = await router.by_node(key for key, _ in events)
        except Exception as exc:  # no slot map: the round is lost, the next one loads it
            self._lost(len(events), exc)
            return
        on = {key: node for node, slots in plan.items() for keys in slots.values() for key in keys}
        parts = {node: [e for e in events if on[e[0]] == node] for node in plan}
        await asyncio.gather(
            *(self._write_to(router.client(n), part, router) for n, part in parts.items())
        )

    async def _write_to(
        self, client: aioredis.Redis, events: list[Event], router: ClusterRouter | None = None
    ) -> None:
        """One pipeline of ``events`` (their XADDs in order, then each key's EXPIRE)."""
        pipe = client.pipeline(transaction=False)
        for key, fields in events:
            pipe.xadd(key, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]  # redis-py types the fields as a narrower mapping
        for key in dict.fromkeys(key for key, _ in events):
            pipe.expire(key, self._ttl_s)
        try:
            await pipe.execute()
            self.written += len(events)
        except Exception as exc:  # a preview: the results never wait for it
            if router is not None:
                if isinstance(exc, MovedError):
                    router.moved(exc)
                elif is_topology_error(exc):
                    router.mark_stale()
            self._lost(len(events), exc)

    def _lost(self, count: int, exc: BaseException) -> None:
        self.dropped += count
        log.warning("%d stream events dropped: Redis failed (%r)", count, exc)

    async def cancelled(self, request_ids: list[str]) -> list[bool]:
        """Whether each request's cancel key is set (``conveyor:cancel:<id>``): one
        pipeline, or one per primary on a cluster. Raises what Redis raises."""
        keys = [cancel_key(request_id) for request_id in request_ids]
        if isinstance(self._store, aioredis.Redis):
            pipe = self._store.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(found) for found in await pipe.execute()]
        answers = await per_key(self._store, keys, lambda pipe, key: pipe.exists(key), TIMEOUT_S)
        for answer in answers.values():
            if isinstance(answer, Exception):
                raise answer
        return [bool(answers[key]) for key in keys]

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            with suppress(Exception):
                await asyncio.wait_for(self._writer, 5.0)
            if not self._writer.done():
                self._writer.cancel()
