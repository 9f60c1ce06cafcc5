"""When offsets are committed: the one place that decides.

The order is fixed elsewhere (a span is finished only after its results are
durable, ``workers.offsets``); this class decides *when* the positions that order
allows are sent to Kafka:

- after every publish, in the background: at most one commit is in flight, and a
  publish that finishes while one is running asks for another when it is done,
  so publishing never waits for the broker's commit round trip and the committed
  position trails the durable results by about one commit;
- at once, and awaited, when partitions are revoked, when the worker is idle, and
  when it stops (``flush``).

A commit that fails (a broker outage, a rebalance) is simply tried again with
the next one: committing less only causes redelivery, never loss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from workers.offsets import OffsetTracker
from workers.types import RecordSource, TopicPartition

log = logging.getLogger(__name__)


class Committer:
    """Commits the tracker's committable positions through the record source."""

    def __init__(self, tracker: OffsetTracker[TopicPartition], source: RecordSource) -> None:
        self._tracker = tracker
        self._source = source
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def request(self) -> None:
        """Commit soon, without waiting (after a publish)."""
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.create_task(self._background(), name="commit")

    async def flush(self, partitions: Collection[TopicPartition] | None = None) -> None:
        """Commit now (only ``partitions`` when given) and wait for it."""
        await self.wait()
        await self._commit(partitions)

    async def wait(self) -> None:
        """Wait for the commit in the background, if one runs."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def close(self) -> None:
        """Cancel a background commit (for an abrupt stop: nothing is lost by it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _background(self) -> None:
        while True:
            self._again = False
            await self._commit(None)
            if not self._again:
                return

    async def _commit(self, partitions: Collection[TopicPartition] | None) -> None:
        positions = self._tracker.committable()
        if partitions is not None:
            positions = {tp: pos for tp, pos in positions.items() if tp in partitions}
        if positions and await self._source.commit(positions):
            self._tracker.mark_committed(positions)
