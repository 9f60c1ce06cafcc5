"""A shadow's result store: nothing, since a shadow never writes to Redis.

A shadow worker (``--shadow``) answers every request of the model in a consumer group
of its own, so that its version can be compared with the one callers get
(``conveyor compare``). Its answers must change nothing a caller sees:

- no Redis: ``NoResultStore`` stores nothing (every id counts as new, so each result
  goes out as computed);
- no reply topic: its results go to the publisher's results topic, which for a shadow
  is ``<prefix>.<model>.shadow-results`` (``WorkerSettings.topics``), whatever
  ``ce_replyto`` a request names, and no dead letters (``Answers(shadow=True)``): the
  primary group copies a record it cannot serve to the DLQ, and the shadow's error
  result on its own topic says what it made of it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NoResultStore"]


class NoResultStore:
    """A ``ResultStore`` that keeps nothing."""

    async def write_first(self, ids: Sequence[str], values: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(ids)

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
