"""Single-key commands on many keys of a Redis Cluster: one pipeline per primary.

Payloads by reference, cancellation and status use plain single-key commands
(``GET``, ``SET``, ``STRLEN``, ``HGETALL``) whose keys fall in any slot. On a
standalone Redis they go in one pipeline; on a cluster ``per_key`` groups them by
the primary that serves each key (``ClusterRouter.by_node``), sends one pipeline
to each primary concurrently, and follows ``MOVED`` answers and failovers for up
to ``budget_s`` seconds, as the result store does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from redis.asyncio.client import Pipeline
from redis.exceptions import MovedError

from common.redis_cluster import ClusterRouter, Node, is_topology_error

__all__ = ["per_key"]

Command = Callable[[Pipeline, str], object]
"""Queues one command for a key on a pipeline, e.g. ``lambda pipe, key: pipe.get(key)``."""


async def per_key(
    router: ClusterRouter, keys: Collection[str], command: Command, budget_s: float
) -> dict[str, Any]:
    """``command`` for every key, answers by key; a per-key error (e.g. ``WRONGTYPE``,
    ``NOPERM``) is the exception object itself. Raises what the cluster still answers
    with after ``budget_s`` (a topology error, a lost connection)."""

    async def node(node: Node, slots: dict[int, list[str]]) -> dict[str, Any]:
        pipe = router.client(node).pipeline(transaction=False)
        ordered = [key for group in slots.values() for key in group]
        for key in ordered:
            command(pipe, key)
        answers = await pipe.execute(raise_on_error=False)
        for answer in answers:
            if isinstance(answer, MovedError) or (
                isinstance(answer, Exception) and is_topology_error(answer)
            ):
                raise answer  # ``retrying`` follows it and runs the attempt again
        return dict(zip(ordered, answers, strict=True))

    async def attempt() -> dict[str, Any]:
        plan = await router.by_node(keys)
        parts = await asyncio.gather(*(node(n, slots) for n, slots in plan.items()))
        found: dict[str, Any] = {}
        for part in parts:
            found.update(part)
        return found

    return await router.retrying(attempt, budget_s)
