"""The model stage: batches run on one thread of their own; finished ones go back to the loop.

``Inference.submit`` hands a closed batch to the model thread and returns at once
(after waiting for a free slot: at most ``SLOTS`` batches are queued there, one
running and one ready to go, so the next batch forms while the current one runs).
The thread re-checks deadlines (a batch may have waited behind the running one),
runs the batch on the ``ModelRunner``, bisects a batch that raises so that a bad
item fails alone, and hands the ``Outcome`` to ``on_done`` on the event loop.

It also measures what the model can do (``seconds_per_item`` over recent batches),
which the pipeline uses to keep only a few seconds of work in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from schemas import ContractError, ErrorCode
from workers.runner import ModelRunner
from workers.types import BatchTiming, Item, Outcome, Refusal

log = logging.getLogger(__name__)

SLOTS = 2  # batches queued on the model thread: one running, one ready to go
_EWMA = 0.2  # weight of the newest batch in seconds_per_item


class Inference:
    """Runs batches of items on one model, one at a time, off the event loop."""

    def __init__(self, runner: ModelRunner, on_done: Callable[[Outcome], None]) -> None:
        self._runner = runner
        self._on_done = on_done
        self._thread = ThreadPoolExecutor(1, "conveyor-model")
        self._slots = asyncio.Semaphore(SLOTS)
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.seconds_per_item: float | None = None
        """Model time per item over recent batches (None before the first batch)."""

    async def wait_for_slot(self) -> None:
        """Wait until the model thread can take another batch; call ``submit`` next."""
        await self._slots.acquire()

    def release_slot(self) -> None:
        """Give back a slot taken with ``wait_for_slot`` that no batch used."""
        self._slots.release()

    def submit(self, items: list[Item]) -> None:
        """Run ``items`` (a slot taken with ``wait_for_slot``) and report the Outcome."""
        loop = asyncio.get_running_loop()
        self._running += 1
        self._idle.clear()

        def finished(outcome: Outcome) -> None:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
            self._slots.release()
            self._on_done(outcome)

        def run() -> None:
            outcome = self._run(items)
            loop.call_soon_threadsafe(finished, outcome)

        self._thread.submit(run)

    async def wait_idle(self) -> None:
        """Wait until every submitted batch has been reported."""
        await self._idle.wait()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # -- the model thread ---------------------------------------------------------------

    def _run(self, items: list[Item]) -> Outcome:
        try:
            return self._infer(items)
        except Exception as exc:  # a bug in this stage must not lose the batch
            log.exception("inference stage failed on a batch of %d", len(items))
            return Outcome(
                refused=[_refuse(i, ErrorCode.internal, f"worker failed: {exc!r}") for i in items]
            )

    def _infer(self, items: list[Item]) -> Outcome:
        now = time.monotonic()
        expired = [i for i in items if i.deadline_at is not None and i.deadline_at <= now]
        if expired:  # they waited behind the running batch past their deadline
            gone = set(map(id, expired))
            items = [i for i in items if id(i) not in gone]
        refused = [expired_refusal(i) for i in expired]
        if not items:
            return Outcome(refused=refused)
        start_ms, start = time.time() * 1000.0, time.monotonic()
        outputs = self._isolated(items)
        seconds = time.monotonic() - start
        timing = BatchTiming(start_ms, time.time() * 1000.0, seconds * 1000.0, len(items))
        self._measure(seconds, len(items))
        answered, answers = [], []
        for item, output in zip(items, outputs, strict=True):
            if isinstance(output, _Failure):
                refusal = _refuse(item, output.code, output.message)
                refusal.batch = timing
                refused.append(refusal)
            else:
                answered.append(item)
                answers.append(output)
        return Outcome(answered, answers, timing, refused)

    def _measure(self, seconds: float, size: int) -> None:
        per_item = seconds / size
        previous = self.seconds_per_item
        self.seconds_per_item = (
            per_item if previous is None else previous + _EWMA * (per_item - previous)
        )

    def _isolated(self, items: Sequence[Item]) -> list[Any]:
        """Outputs of ``items``; a batch that raises is halved until the bad item is alone."""
        try:
            return self._runner.run([i.tensor for i in items], [i.meta.params for i in items])
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()  # give the halves the memory the failed batch held
            if len(items) == 1:
                return [_Failure(ErrorCode.out_of_memory, f"out of memory even alone: {exc}")]
        except ContractError as exc:  # e.g. a JPEG that only fails when decoded in batch
            if len(items) == 1:
                return [_Failure(exc.code, str(exc))]
        except Exception as exc:
            if len(items) == 1:
                request_id = items[0].meta.id
                log.warning(
                    "model failed on request %s: %r",
                    request_id,
                    exc,
                    extra={"request_id": request_id},
                )
                return [_Failure(ErrorCode.model_error, f"model failed on this input: {exc!r}")]
        half = len(items) // 2
        return self._isolated(items[:half]) + self._isolated(items[half:])


class _Failure:
    __slots__ = ("code", "message")

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code = code
        self.message = message


def _refuse(item: Item, code: ErrorCode, message: str) -> Refusal:
    meta = item.meta
    return Refusal(
        item.record,
        item.span,
        code,
        message,
        None,
        meta.id,
        item.received_ms,
        reply_to=meta.reply_to,
        traceparent=meta.traceparent,
    )


def expired_refusal(item: Item) -> Refusal:
    """The deadline passed before the model ran: ``expired``, no dead letter."""
    deadline = item.meta.deadline
    when = deadline.isoformat() if deadline is not None else "(max age)"
    refusal = _refuse(item, ErrorCode.expired, f"deadline {when} passed before inference")
    refusal.dead_letter = False
    return refusal


def superseded_refusal(item: Item) -> Refusal:
    """A newer frame of the item's stream was waiting: ``superseded``, no dead letter."""
    meta = item.meta
    frame = "a frame" if meta.seq is None else f"frame {meta.seq}"
    refusal = _refuse(
        item,
        ErrorCode.superseded,
        f"{frame} of stream {meta.stream} was superseded by a newer frame of the stream "
        "before inference (freshest-frame mode)",
    )
    refusal.dead_letter = False
    return refusal
