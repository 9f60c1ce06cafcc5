"""The publish stage: finished work, delivered in calls of all that is waiting, overlapping.

Every ``Outcome`` (answered items, refusals) goes through ``outcomes``; the stage takes
all that is waiting into one ``Delivery.deliver`` call and never waits for more. Up to
the delivery's ``at_once`` calls are in progress at a time (at least once: a call waits
for the broker's acknowledgements while the next one writes; exactly once: one after
another). ``None`` on the queue ends the stage once every call has finished; an outcome
of a failed device ends it after the calls in progress, raising the device's error.

With tracing on (``workers.observe.tracing``), each call's traced requests get their
spans once the call has made them durable; off, nothing here looks at a request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from workers.batching.lanes import LaneTopics
from workers.delivery.policies import Delivery
from workers.observe.metrics import Metrics
from workers.types import DeviceLost, Outcome

if TYPE_CHECKING:  # imported only when tracing is on: it loads the OpenTelemetry SDK
    from workers.observe.tracing import Tracing


class Publishing:
    """Delivers outcomes as they come and counts what became durable."""

    def __init__(
        self,
        delivery: Delivery,
        metrics: Metrics,
        lanes: LaneTopics,
        tracing: Tracing | None = None,
    ) -> None:
        self._delivery = delivery
        self._metrics = metrics
        self._lanes = lanes
        self._tracing = tracing
        self.outcomes: asyncio.Queue[Outcome | None] = asyncio.Queue()
        self.progress = asyncio.Event()
        """Set after every delivery call (cleared by whoever waits for the next)."""

    async def run(self) -> None:
        """Deliver until ``None`` arrives; raises ``DeviceLost`` for a failed device."""
        slots = asyncio.Semaphore(self._delivery.at_once)
        lost: DeviceLost | None = None
        async with asyncio.TaskGroup() as calls:
            while lost is None:
                await slots.acquire()
                outcomes, last = await self._waiting()
                if outcomes:
                    answered = [o for o in outcomes if o.lost is None]
                    calls.create_task(self._deliver(answered, slots))
                else:
                    slots.release()
                # The device failed: stop once the rest is delivered, these unanswered.
                lost = next((o.lost for o in outcomes if o.lost is not None), None)
                if last:
                    break
        if lost is not None:
            raise lost

    async def _waiting(self) -> tuple[list[Outcome], bool]:
        """Every outcome waiting (at least one, unless the queue ended), and whether the
        queue ended."""
        first = await self.outcomes.get()
        if first is None:
            return [], True
        outcomes = [first]
        while not self.outcomes.empty():
            more = self.outcomes.get_nowait()
            if more is None:
                return outcomes, True
            outcomes.append(more)
        return outcomes, False

    async def _deliver(self, outcomes: list[Outcome], slots: asyncio.Semaphore) -> None:
        sent_ms = time.time() * 1000.0
        try:
            delivered = await self._delivery.deliver(outcomes)
        finally:
            slots.release()
        durable_ms = time.time() * 1000.0
        if self._tracing is not None:
            self._tracing.record(delivered.outcomes, sent_ms, durable_ms)
        for built in delivered.built:
            self._metrics.observe_results(
                built.statuses,
                [(durable_ms - produced) / 1000.0 for produced in built.produced_ms],
            )
            self._metrics.dead_letters(len(built.outbox.dead))
        if self._lanes.several:
            for lane, e2e_s in self._lanes.end_to_end(delivered.outcomes, durable_ms).items():
                self._metrics.lane_end_to_end(lane, e2e_s)
        self._metrics.duplicates(delivered.duplicates)
        self.progress.set()
