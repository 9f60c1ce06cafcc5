"""Payloads by reference (claim checks): fetch what ``ce_dataref`` names, then preprocess.

A chunk of fetched records that holds any request with a ``ce_dataref`` goes
through ``Claims.resolve`` instead of the plain preprocess; chunks without one
never come here (``Ingest.parse`` says which), so the feature costs nothing
unused. For a chunk, ``resolve``:

1. refuses references this worker may not read (a Redis key outside
   ``--dataref-redis-prefix``, a bucket outside ``--dataref-s3-buckets``, a
   store that is not configured): ``dataref_denied``;
2. asks each store for the sizes of the objects, one round trip per store
   (a Redis pipeline of ``STRLEN``, concurrent S3 ``HEAD``s): a missing object
   is ``dataref_missing`` (``dataref_expired`` once its ``ce_dataexpires`` has
   passed), one above ``max_dataref_bytes`` is ``dataref_too_large``, and
   neither is ever read;
3. reads the rest in groups whose sizes add up to at most the fetch budget
   (``--decode-memory-mb``, shared by all chunks): a group holds its bytes in
   the budget from before it is read until the handler's preprocess has turned
   them into tensors, so referenced payloads held at once stay under the budget
   (one object larger than the whole budget is read alone). A group is one
   Redis pipeline of ``GET`` or concurrent S3 ``GET``s.

Items keep their order within the chunk (a stream's frames stay in order).
A store that cannot be reached (connection refused, time-outs, S3 5xx) is
retried with capped backoff, forever, like the publisher's outages: nothing
behind the chunk is answered meanwhile, so backpressure pauses fetching, and no
request is lost or answered wrongly. While a store's calls fail it is down
(``conveyor_dataref_store_down``), until one of its calls succeeds again;
``failing_for`` says for how long, and the worker's ``/readyz`` fails once that
passes ``--unready-after-s``, as it does while results cannot be written. Nothing
here raises for a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis.asyncio as aioredis

from common.redis_cluster import ClusterRouter
from common.s3 import S3Unavailable, s3_client
from common.security import redis_options
from schemas import DataRef, ErrorCode
from workers.config.worker import WorkerSettings
from workers.intake.payload_stores import (
    ClusterRedisPayloads,
    Fault,
    PayloadStore,
    RedisPayloads,
    S3Payloads,
    StoreOutage,
    too_large,
)
from workers.observe.metrics import Metrics
from workers.types import ConfigError, Item, Refusal

log = logging.getLogger(__name__)
T = TypeVar("T")

Decoded = tuple[list[Item], list[Refusal]]
Prepare = Callable[[list[Item], list[bytes]], Awaitable[Decoded]]
"""The pipeline's preprocess: items with their payloads, to tensors or refusals."""

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 5.0


class ByteBudget:
    """Bytes of referenced payloads held at once, shared by every chunk being resolved.

    ``hold`` takes all of its bytes at once (never a part while waiting for the
    rest), so chunks waiting on each other cannot deadlock; a request above the
    whole limit waits until it can run alone.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a fetch budget needs at least 1 byte, got {limit_bytes}")
        self.limit = limit_bytes
        self.used = 0
        self._room = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        nbytes = min(max(nbytes, 0), self.limit)
        async with self._room:
            await self._room.wait_for(lambda: self.used + nbytes <= self.limit)
            self.used += nbytes
        try:
            yield
        finally:
            async with self._room:
                self.used -= nbytes
                self._room.notify_all()


class Claims:
    """Resolves the references of chunks for one worker: its stores, rules and budget."""

    def __init__(
        self,
        stores: Mapping[str, PayloadStore],
        *,
        redis_prefix: str,
        s3_buckets: frozenset[str],
        max_bytes: int,
        budget_bytes: int,
        metrics: Metrics,
        backoff_start_s: float = _BACKOFF_START_S,
    ) -> None:
        self._stores = dict(stores)
        self._redis_prefix = redis_prefix
        self._s3_buckets = s3_buckets
        self._max_bytes = max_bytes
        self._budget = ByteBudget(budget_bytes)
        self._metrics = metrics
        self._backoff_start_s = backoff_start_s
        self._down_since: dict[str, float] = {}  # store -> monotonic time of its first failure
        for name in self._stores:
            metrics.dataref_store_down(name, False)

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: WorkerSettings, metrics: Metrics) -> AsyncIterator[Claims]:
        """The worker's claims: its Redis (always) and its S3 store (when buckets are set).

        Payloads travel on a Redis connection pool of their own, so a 50 MB read never
        queues a batch's result script behind it.
        """
        async with contextlib.AsyncExitStack() as stack:
            url = settings.redis_url.get_secret_value()
            options: dict[str, Any] = {
                "socket_timeout": 30,
                "socket_connect_timeout": 5,
                **redis_options(settings),
            }
            stores: dict[str, PayloadStore] = {}
            if settings.redis_cluster:
                router = ClusterRouter(url, options)
                stack.push_async_callback(router.aclose)
                stores["redis"] = ClusterRedisPayloads(router)
            else:
                client = aioredis.Redis.from_url(url, **options)
                stack.push_async_callback(client.aclose)
                stores["redis"] = RedisPayloads(client)
            if settings.s3_buckets:
                try:
                    s3 = await stack.enter_async_context(s3_client(settings))
                except S3Unavailable as exc:
                    raise ConfigError(f"--dataref-s3-buckets is set, but {exc}") from None
                stores["s3"] = S3Payloads(s3)
            yield cls.from_settings(settings, metrics, stores)

    @classmethod
    def from_settings(
        cls, settings: WorkerSettings, metrics: Metrics, stores: Mapping[str, PayloadStore]
    ) -> Claims:
        """Claims on ``stores`` under the worker's rules (with no stores, every reference
        is refused ``dataref_denied``)."""
        return cls(
            stores,
            redis_prefix=settings.dataref_redis_prefix,
            s3_buckets=settings.s3_buckets,
            max_bytes=settings.limits.max_dataref_bytes,
            budget_bytes=settings.decode_memory_mb * 1024 * 1024,
            metrics=metrics,
        )

    @property
    def budget(self) -> ByteBudget:
        return self._budget

    def failing_for(self) -> float:
        """Seconds since the store that is down the longest began failing (0 when every
        store answers): its calls fail and are retried, and the requests behind them wait."""
        if not self._down_since:
            return 0.0
        return time.monotonic() - min(self._down_since.values())

    async def resolve(self, items: list[Item], prepare: Prepare) -> Decoded:
        """Fetch the referenced payloads of ``items`` and ``prepare`` all of them, in order."""
        try:
            return await self._resolve(items, prepare)
        except Exception as exc:  # a bug here must not lose the chunk
            log.exception("resolving payload references failed for %d items", len(items))
            message = f"worker failed reading payload references: {exc!r}"
            return [], [_refusal(item, Fault(ErrorCode.internal, message)) for item in items]

    async def _resolve(self, items: list[Item], prepare: Prepare) -> Decoded:
        ready: list[Item] = []
        refused: list[Refusal] = []
        plain = [item for item in items if item.meta.dataref is None]
        if plain:
            done, failed = await prepare(plain, [item.record.value or b"" for item in plain])
            ready += done
            refused += failed
        wanted = []
        for item in items:
            ref = item.meta.dataref
            if ref is None:
                continue
            fault = self._check_allowed(ref)
            if fault is None:
                wanted.append(item)
            else:
                refused.append(_refusal(item, fault))
        sized = await self._sizes(wanted, refused)
        for group in _groups(sized, self._budget.limit):
            async with self._budget.hold(sum(size for _, size in group)):
                done, failed = await self._read_and_prepare([item for item, _ in group], prepare)
            ready += done
            refused += failed
        if len(ready) > 1:
            order = {id(item): n for n, item in enumerate(items)}
            ready.sort(key=lambda item: order[id(item)])
        return ready, refused

    def _check_allowed(self, ref: DataRef) -> Fault | None:
        if ref.store not in self._stores:
            return Fault(
                ErrorCode.dataref_denied,
                f"this worker reads no {ref.store} references ({ref.uri}); its operator "
                "sets --dataref-s3-buckets and the s3 settings to serve them",
            )
        if ref.store == "redis" and not ref.key.startswith(self._redis_prefix):
            return Fault(
                ErrorCode.dataref_denied,
                f"this worker reads Redis keys starting with {self._redis_prefix!r} only, "
                f"not {ref.key!r}",
            )
        if ref.store == "s3" and ref.bucket not in self._s3_buckets:
            return Fault(
                ErrorCode.dataref_denied,
                f"this worker does not read bucket {ref.bucket!r}; it reads "
                + ", ".join(sorted(self._s3_buckets)),
            )
        return None

    async def _sizes(self, items: list[Item], refused: list[Refusal]) -> list[tuple[Item, int]]:
        """The items whose objects exist and fit, with their sizes; refusals for the rest."""
        answers = await self._per_store(items, lambda store, refs: store.sizes(refs))
        sized = []
        for item, answer in zip(items, answers, strict=True):
            ref = _ref(item)
            if isinstance(answer, int) and answer > self._max_bytes:
                answer = too_large(ref, answer, self._max_bytes)
            if isinstance(answer, int):
                sized.append((item, answer))
            else:
                refused.append(_refusal(item, answer or _missing(ref)))
        return sized

    async def _read_and_prepare(self, items: list[Item], prepare: Prepare) -> Decoded:
        max_bytes = self._max_bytes
        answers = await self._per_store(items, lambda store, refs: store.read(refs, max_bytes))
        found: list[Item] = []
        payloads: list[bytes] = []
        refused: list[Refusal] = []
        for item, answer in zip(items, answers, strict=True):
            if isinstance(answer, bytes) and answer:
                found.append(item)
                payloads.append(answer)
            else:
                fault = answer if isinstance(answer, Fault) else _missing(_ref(item))
                refused.append(_refusal(item, fault))
        self._metrics.dataref_fetched(len(payloads), sum(map(len, payloads)))
        answers.clear()
        if found:
            done, failed = await prepare(found, payloads)
            refused += failed
            return done, refused
        return [], refused

    async def _per_store(
        self,
        items: list[Item],
        ask: Callable[[PayloadStore, list[DataRef]], Awaitable[Sequence[T]]],
    ) -> list[T]:
        """``ask`` each store about its items' references (stores concurrently, each
        retried through outages); the answers in the order of ``items``."""
        by_store: dict[str, list[int]] = {}
        for n, item in enumerate(items):
            by_store.setdefault(_ref(item).store, []).append(n)
        answers: list[T | None] = [None] * len(items)

        async def one(name: str, indices: list[int]) -> None:
            refs = [_ref(items[n]) for n in indices]
            got = await self._retry(name, lambda: ask(self._stores[name], refs))
            for n, answer in zip(indices, got, strict=True):
                answers[n] = answer

        await asyncio.gather(*(one(name, indices) for name, indices in by_store.items()))
        return answers  # type: ignore[return-value]  # every slot was filled above

    async def _retry(self, store: str, call: Callable[[], Awaitable[T]]) -> T:
        delay = self._backoff_start_s
        while True:
            try:
                answer = await call()
            except StoreOutage as exc:
                self._metrics.dataref_retry(store)
                if store not in self._down_since:
                    self._down_since[store] = time.monotonic()
                    self._metrics.dataref_store_down(store, True)
                log.warning("%s payload store failed (%s); retrying in %.1f s", store, exc, delay)
            else:
                if self._down_since.pop(store, None) is not None:
                    self._metrics.dataref_store_down(store, False)
                    log.info("%s payload store answers again", store)
                return answer
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)


def _groups(sized: list[tuple[Item, int]], limit: int) -> list[list[tuple[Item, int]]]:
    """Consecutive items in groups of at most ``limit`` bytes (a larger one alone)."""
    groups: list[list[tuple[Item, int]]] = []
    group: list[tuple[Item, int]] = []
    total = 0
    for entry in sized:
        if group and total + entry[1] > limit:
            groups.append(group)
            group, total = [], 0
        group.append(entry)
        total += entry[1]
    if group:
        groups.append(group)
    return groups


def _ref(item: Item) -> DataRef:
    ref = item.meta.dataref
    assert ref is not None
    return ref


def _missing(ref: DataRef) -> Fault:
    expires = ref.expires
    if expires is not None and expires <= datetime.now(UTC):
        return Fault(
            ErrorCode.dataref_expired,
            f"{ref.uri} is gone: it was kept until {expires.isoformat()} and the request "
            "waited longer; keep payloads longer (dataref_ttl_s) or serve the backlog faster",
        )
    kept = f" (it was to be kept until {expires.isoformat()})" if expires is not None else ""
    return Fault(
        ErrorCode.dataref_missing,
        f"{ref.uri} does not exist{kept}; store the payload before sending its request",
    )


def _refusal(item: Item, fault: Fault) -> Refusal:
    meta = item.meta
    if fault.code is not ErrorCode.internal:
        log.warning(
            "request %s failed: %s: %s",
            meta.id,
            fault.code.value,
            fault.message,
            extra={"request_id": meta.id},
        )
    # Nothing is wrong with a record whose payload outlived its keep: no dead letter.
    return Refusal.of(
        item,
        fault.code,
        fault.message,
        "ce_dataref",
        dead_letter=fault.code is not ErrorCode.dataref_expired,
    )
