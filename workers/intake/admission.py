"""Admission: the last look at a batch before the model, for cancellation and status.

Both features are off by default (``--cancellation``, ``--track-status``); with
either on, every batch costs one Redis script call here, and nothing else changes.
The model stage makes the call (``workers.model.inference``) at the moment the
batch starts: when its thread takes the batch, before its decode on the device
and its forward, not when the batch joins the stage's queue. The thread hands the
call to the event loop and waits for the answer, at most ``timeout_s`` (and a
second more for a busy loop); the batch's start (``batch_start_ms`` of its results) is the
moment the call was sent, so a cancellation Redis recorded before that moment is
always seen.

- cancellation: a request whose ``conveyor:cancel:{<id>}`` key exists is taken
  out of the batch and answered ``error``/``cancelled`` without reaching the
  model; its result is written like any other, so a request that already had a
  result keeps it (first final result wins);
- status: every other request of the batch gets its hash
  ``conveyor:status:{<id>}`` (``attempt`` incremented, ``worker``,
  ``started_ms``), kept for the result TTL, and its result carries the
  ``attempt`` count. A reader tells queued (neither key), running (the hash)
  and done (the result key) apart.

A request's cancel and status keys share the Redis Cluster hash tag ``{<id>}``,
so on a cluster (``ClusterRequestState``) a batch is one script call per hash
slot, sent to each primary as one pipeline.

When Redis does not answer within ``timeout_s`` the batch runs as it is
(fail open): cancellation is a request to skip work, never a guarantee, and the
results are published, and retried, the usual way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import redis.asyncio as aioredis

from common.redis_cluster import ClusterRouter, Node
from common.security import redis_options
from schemas import ErrorCode, cancel_key, status_key
from workers.config.worker import WorkerSettings
from workers.observe.metrics import Metrics
from workers.publish.errors import is_outage
from workers.types import Admitted, Item, Refusal

log = logging.getLogger(__name__)

CANCELLED = 0
"""What ``RequestState.start`` answers for a cancelled request (attempts start at 1)."""

START_SCRIPT = """
local check, track, ttl, worker, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local out = {}
for i = 1, #KEYS, 2 do
  local n = (i + 1) / 2
  if check == '1' and redis.call('EXISTS', KEYS[i]) == 1 then
    out[n] = 0
  elseif track == '1' then
    out[n] = redis.call('HINCRBY', KEYS[i + 1], 'attempt', 1)
    redis.call('HSET', KEYS[i + 1], 'worker', worker, 'started_ms', now)
    redis.call('EXPIRE', KEYS[i + 1], ttl)
  else
    out[n] = 1
  end
end
return out
"""
"""KEYS: per request, its cancel key then its status key. ARGV: check cancels ("1"/"0"),
track status ("1"/"0"), status TTL in seconds, worker id, now (epoch ms).
Returns per request 0 when cancelled, else its attempt number (1 without tracking)."""


def script_flags(settings: WorkerSettings) -> list[str]:
    """``START_SCRIPT``'s first arguments for a worker: what to check, the TTL, its id."""
    return [
        "1" if settings.cancellation else "0",
        "1" if settings.track_status else "0",
        str(settings.result_ttl_s),
        settings.worker_id,
    ]


class RequestState(Protocol):
    """Where cancellations and running markers live (Redis: ``RedisRequestState``)."""

    async def start(self, ids: Sequence[str]) -> list[int]:
        """For a batch about to run: per id, ``CANCELLED`` or its attempt number."""


class RedisRequestState:
    """``RequestState`` on one Redis server: one ``START_SCRIPT`` call per batch.

    A Redis Cluster adapter runs the same script once per hash slot of the ids
    (both keys of an id are in the slot of ``{<id>}``) and puts the answers back
    in the order of ``ids``.
    """

    def __init__(self, client: aioredis.Redis, flags: Sequence[str]) -> None:
        """``flags``: the script's first arguments (``script_flags``)."""
        self._script = client.register_script(START_SCRIPT)
        self._flags = list(flags)

    async def start(self, ids: Sequence[str]) -> list[int]:
        keys: list[str] = []
        for request_id in ids:
            keys += (cancel_key(request_id), status_key(request_id))
        now_ms = str(int(time.time() * 1000))
        answers = await self._script(keys=keys, args=[*self._flags, now_ms])
        return [int(answer) for answer in answers]


class ClusterRequestState:
    """``RequestState`` on a Redis Cluster: ``START_SCRIPT`` once per hash slot of the
    batch's ids, one pipeline per primary, concurrently; answers back in id order."""

    def __init__(self, router: ClusterRouter, flags: Sequence[str], budget_s: float = 1.0) -> None:
        self._router = router
        self._flags = list(flags)
        self._budget_s = budget_s

    async def start(self, ids: Sequence[str]) -> list[int]:
        ids_of = {cancel_key(request_id): request_id for request_id in ids}
        args = [*self._flags, str(int(time.time() * 1000))]

        async def node(node: Node, slots: dict[int, list[str]]) -> dict[str, int]:
            pipe = self._router.client(node).pipeline(transaction=False)
            groups = list(slots.values())
            for group in groups:
                keys: list[str] = []
                for key in group:
                    keys += (key, status_key(ids_of[key]))
                pipe.eval(START_SCRIPT, len(keys), *keys, *args)
            answers = await pipe.execute(raise_on_error=False)
            found: dict[str, int] = {}
            for group, answer in zip(groups, answers, strict=True):
                if isinstance(answer, Exception):
                    raise answer  # MOVED or a failover: the router retries the batch
                found.update(zip(group, map(int, answer), strict=True))
            return found

        async def attempt() -> dict[str, int]:
            plan = await self._router.by_node(ids_of)
            parts = await asyncio.gather(*(node(n, slots) for n, slots in plan.items()))
            return {key: answer for part in parts for key, answer in part.items()}

        found = await self._router.retrying(attempt, self._budget_s)
        return [found[cancel_key(request_id)] for request_id in ids]


class Admission:
    """Takes cancelled requests out of each batch and numbers the attempts of the rest."""

    @classmethod
    @asynccontextmanager
    async def open(
        cls, settings: WorkerSettings, metrics: Metrics
    ) -> AsyncIterator[Admission | None]:
        """The worker's admission on its Redis; None when both features are off."""
        if not (settings.cancellation or settings.track_status):
            yield None
            return
        url = settings.redis_url.get_secret_value()
        options = {"socket_timeout": 5, "socket_connect_timeout": 5, **redis_options(settings)}
        flags = script_flags(settings)
        state: RequestState
        if settings.redis_cluster:
            router = ClusterRouter(url, options)
            state, close = ClusterRequestState(router, flags), router.aclose
        else:
            client = aioredis.Redis.from_url(url, **options)
            state, close = RedisRequestState(client, flags), client.aclose
        try:
            yield cls(state, metrics)
        finally:
            await close()

    def __init__(self, state: RequestState, metrics: Metrics, timeout_s: float = 1.0) -> None:
        self._state = state
        self._metrics = metrics
        self.timeout_s = timeout_s

    async def admit(self, items: list[Item]) -> Admitted:
        """The items to run (``attempt`` set), refusals for the cancelled ones, and the
        moment the check was sent."""
        checked_ms = time.time() * 1000.0
        try:
            async with asyncio.timeout(self.timeout_s):
                answers = await self._state.start([item.meta.id for item in items])
        except Exception as exc:
            if not (is_outage(exc) or isinstance(exc, TimeoutError)):
                raise
            self.skipped(len(items), f"{type(exc).__name__}: {exc}")
            return Admitted(items, [], checked_ms)
        admitted: list[Item] = []
        cancelled: list[Refusal] = []
        for item, answer in zip(items, answers, strict=True):
            if answer == CANCELLED:
                cancelled.append(_cancelled(item))
            else:
                item.attempt = answer
                admitted.append(item)
        if cancelled:
            self._metrics.cancelled(len(cancelled))
        return Admitted(admitted, cancelled, checked_ms)

    def skipped(self, size: int, why: str) -> None:
        """Count and log a batch that runs without its check (from any thread)."""
        self._metrics.admission_failed()
        log.warning(
            "cancellation and status check failed (%s); running the batch of %d as it is",
            why,
            size,
        )


def _cancelled(item: Item) -> Refusal:
    return Refusal.of(
        item,
        ErrorCode.cancelled,
        "cancelled before it ran (its conveyor:cancel key was set)",
        dead_letter=False,
    )
