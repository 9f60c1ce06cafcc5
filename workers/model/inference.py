"""The model stage: batches run off the event loop; finished ones go back to the loop.

``Inference.submit`` hands a closed batch to the stage and returns at once (after
waiting for a free slot: a bounded number of batches is in the stage at a time,
so the next batch forms while the current ones run). The stage re-checks
deadlines (a batch may have waited behind a running one), runs the batch on the
``ModelRunner``, bisects a batch that raises so that a bad item fails alone, and
hands the ``Outcome`` to ``on_done`` on the event loop.

On the CPU one thread does all of it, a batch at a time. On a GPU the stage is a
pipeline of three threads, so that the device is never left waiting on Python:

    prepare (decode + upload, staging stream) ─▶ launch (forward + device postprocess,
    compute stream, no waiting) ─▶ finish (wait for the small outputs, build results)

While batch N runs on the device, batch N+1 is decoded on another stream and
batch N-1's results are built on the host; the only host synchronisation per
batch is ``finish`` waiting for N's outputs, off the launching thread. A batch
that fails anywhere is run again on the launch thread the simple way (prepare,
forward, postprocess, halves on failure), which keeps bisection in one place.

With cancellation or status tracking on, the thread that starts a batch (model on
the CPU, prepare on a GPU) first has the event loop run its admission
(``workers.intake.admission``, one Redis round trip) and waits for it: a batch is
checked and marked running as it starts, not as it joined the stage.

It also measures what the model can do (``seconds_per_item`` over recent batches,
device time on a GPU), which the pipeline uses to keep only a few seconds of work
in flight.
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
from workers.model.runner import DeviceBatch, Launched, ModelRunner
from workers.types import AdmissionCheck, BatchTiming, DeviceLost, Item, Outcome, Refusal

log = logging.getLogger(__name__)

SLOTS = 2  # batches in a serial stage by default: one running, one ready to go
PIPELINED_SLOTS = 4  # by default: preparing, launched, finishing, and one ready to go
PARTIAL_SLOTS = 2  # of those, by default, how many may be partial batches
_EWMA = 0.2  # weight of the newest batch in seconds_per_item
_LOOP_SLACK_S = 1.0  # beyond the admission's own bound: the loop may be busy a moment


class Inference:
    """Runs batches of items on one model, off the event loop."""

    def __init__(
        self,
        runner: ModelRunner,
        on_done: Callable[[Outcome], None],
        *,
        pipelined: bool | None = None,
        batches: int | None = None,
        partial: int | None = None,
        admission: AdmissionCheck | None = None,
    ) -> None:
        """``pipelined`` (default: on a GPU) runs prepare, launch and finish on three
        threads; otherwise one thread runs each batch from start to end. ``batches``
        bounds the batches in the stage at once, the running ones included (default
        ``PIPELINED_SLOTS`` pipelined, else ``SLOTS``): while they are all there, the
        next batch keeps forming. ``partial`` (default ``PARTIAL_SLOTS``, at most
        ``batches``): while that many are there, only a full batch may join them.

        ``admission`` (none: off) checks each batch on the event loop as it starts; the
        requests it finds cancelled go to ``on_done`` at once, in an outcome of their own.

        Under a backlog every batch is full and the stage is as deep as ``batches``
        allows, to keep the device busy; under light load the small batches queued
        on the device would each cost a forward, so the next one grows instead."""
        self._runner = runner
        self._on_done = on_done
        self._admission = admission
        self._loop: asyncio.AbstractEventLoop | None = None  # the submitter's, for admission
        if pipelined is None:
            pipelined = runner.device.type == "cuda"
        self._thread = ThreadPoolExecutor(1, "conveyor-model")
        self._prepare_thread = ThreadPoolExecutor(1, "conveyor-prepare") if pipelined else None
        self._finish_thread = ThreadPoolExecutor(1, "conveyor-finish") if pipelined else None
        if batches is None:
            batches = PIPELINED_SLOTS if pipelined else SLOTS
        if batches < 1:
            raise ValueError(f"the model stage needs room for a batch, got {batches}")
        self._slots = asyncio.Semaphore(batches)
        self._partial = min(batches, PARTIAL_SLOTS if partial is None else partial)
        if self._partial < 1:
            raise ValueError(f"the model stage needs room for a partial batch, got {partial}")
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.seconds_per_item: float | None = None
        """Model time per item over recent batches (None before the first batch)."""

    async def wait_for_slot(self) -> None:
        """Wait until the stage can take another batch; call ``submit`` next."""
        await self._slots.acquire()

    def takes_partial(self) -> bool:
        """Whether a batch that is not full may join the stage now (see ``partial``)."""
        return self._running < self._partial

    def release_slot(self) -> None:
        """Give back a slot taken with ``wait_for_slot`` that no batch used."""
        self._slots.release()

    def submit(self, items: list[Item]) -> None:
        """Run ``items`` (a slot taken with ``wait_for_slot``) and report the Outcome."""
        loop = self._loop = asyncio.get_running_loop()
        self._running += 1
        self._idle.clear()

        def finished(outcome: Outcome) -> None:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
            self._slots.release()
            self._on_done(outcome)

        def deliver(outcome: Outcome) -> None:
            loop.call_soon_threadsafe(finished, outcome)

        if self._prepare_thread is not None:
            self._prepare_thread.submit(self._prepare, items, deliver)
        else:
            self._thread.submit(lambda: deliver(self._run(items)))

    async def wait_idle(self) -> None:
        """Wait until every submitted batch has been reported."""
        await self._idle.wait()

    def close(self) -> None:
        for thread in (self._prepare_thread, self._thread, self._finish_thread):
            if thread is not None:
                thread.shutdown(wait=False, cancel_futures=True)

    # -- the pipeline (GPU): prepare ─▶ launch ─▶ finish ------------------------------------

    def _prepare(self, items: list[Item], deliver: Callable[[Outcome], None]) -> None:
        """Prepare thread: drop what expired or was cancelled, then decode and upload on
        the staging stream. The batch's time in the model starts here, as the serial
        path's does: its decode and upload are part of its compute (``BatchTiming``)."""
        try:
            items, refused, start_ms = self._started(items)
        except Exception as exc:  # a bug in the check must not lose the batch
            deliver(self._failed(items, exc))
            return
        if not items:
            deliver(Outcome(refused=refused))
            return
        work_ms = time.time() * 1000.0
        try:
            batch: DeviceBatch | None = self._runner.prepare([i.tensor for i in items])
        except Exception:  # the launch thread runs this batch the simple way, halves and all
            batch = None
        self._thread.submit(self._launch, items, batch, refused, (start_ms, work_ms), deliver)

    def _launch(
        self,
        items: list[Item],
        batch: DeviceBatch | None,
        refused: list[Refusal],
        started: tuple[float, float],
        deliver: Callable[[Outcome], None],
    ) -> None:
        """Launch thread: start the forward and hand the batch to the finish thread
        (``started``: the batch's start and its work's, after its check, epoch ms)."""
        launched = None
        if batch is not None:
            try:
                launched = self._runner.launch(batch, [i.meta.params for i in items])
            except Exception:
                launched = None
        if launched is None:
            deliver(self._guarded(items, lambda: self._serially(items, refused, started[0])))
            return
        assert self._finish_thread is not None
        self._finish_thread.submit(self._finish, items, launched, refused, started, deliver)

    def _finish(
        self,
        items: list[Item],
        launched: Launched,
        refused: list[Refusal],
        started: tuple[float, float],
        deliver: Callable[[Outcome], None],
    ) -> None:
        """Finish thread: wait for the outputs, build the results."""
        start_ms, work_ms = started
        try:
            outputs = self._runner.finish(launched)
        except Exception:  # a failing host postprocess: the simple way, on the launch thread
            self._thread.submit(
                lambda: deliver(
                    self._guarded(items, lambda: self._serially(items, refused, start_ms))
                )
            )
            return
        _keep_images(items, launched)
        finished_ms = time.time() * 1000.0
        seconds = launched.device_seconds()
        if seconds is None:
            seconds = (finished_ms - work_ms) / 1000.0
        self._measure(seconds, len(items))
        timing = BatchTiming(start_ms, finished_ms, finished_ms - work_ms, len(items))
        deliver(Outcome(items, outputs, timing, refused))

    def _serially(self, items: list[Item], refused: list[Refusal], start_ms: float) -> Outcome:
        """The batch the simple way, after a failure in the pipeline; already checked."""
        live, late = _live(items)
        return self._infer(live, refused + late, start_ms)

    # -- one thread, a batch at a time (the CPU, and the pipeline's fallback) ---------------

    def _guarded(self, items: list[Item], run: Callable[[], Outcome]) -> Outcome:
        try:
            return run()
        except DeviceLost as exc:  # not the batch's fault: left for a healthy worker
            log.error("%s; stopping without answering its batches", exc)
            return Outcome(lost=exc)
        except Exception as exc:
            return self._failed(items, exc)

    def _failed(self, items: list[Item], exc: Exception) -> Outcome:
        """A bug in this stage must not lose the batch: every item answered ``internal``."""
        log.error("inference stage failed on a batch of %d", len(items), exc_info=exc)
        return Outcome(
            refused=[Refusal.of(i, ErrorCode.internal, f"worker failed: {exc!r}") for i in items]
        )

    def _run(self, items: list[Item]) -> Outcome:
        def run() -> Outcome:
            live, refused, start_ms = self._started(items)
            return self._infer(live, refused, start_ms)

        return self._guarded(items, run)

    def _started(self, items: list[Item]) -> tuple[list[Item], list[Refusal], float]:
        """Start a batch: its live items cleared to run, refusals for the others (expired,
        cancelled), and the batch's start (epoch ms). The check (after the deadlines, so
        expired requests are never marked running) runs on the loop while this thread
        waits, at most ``admission.timeout_s`` and ``_LOOP_SLACK_S``; then fail open."""
        live, refused = _live(items)
        admission, loop = self._admission, self._loop
        if admission is None or loop is None or not live:
            return live, refused, time.time() * 1000.0
        start_ms = time.time() * 1000.0
        check = asyncio.run_coroutine_threadsafe(admission.admit(live), loop)
        try:
            admitted = check.result(admission.timeout_s + _LOOP_SLACK_S)
        except TimeoutError:
            check.cancel()
            admission.skipped(len(live), "the event loop did not run it in time")
            return live, refused, start_ms
        if not admitted.items:
            return [], refused + admitted.cancelled, admitted.checked_ms
        if admitted.cancelled:  # answered now, not after the forward of the rest
            loop.call_soon_threadsafe(self._on_done, Outcome(refused=admitted.cancelled))
        return admitted.items, refused, admitted.checked_ms

    def _infer(self, items: list[Item], refused: list[Refusal], start_ms: float) -> Outcome:
        """Run ``items`` (already started: ``_started``), bisecting failures."""
        if not items:
            return Outcome(refused=refused)
        start = time.monotonic()
        outputs = self._isolated(items)
        seconds = time.monotonic() - start
        timing = BatchTiming(start_ms, time.time() * 1000.0, seconds * 1000.0, len(items))
        self._measure(seconds, len(items))
        answered, answers = [], []
        for item, output in zip(items, outputs, strict=True):
            if isinstance(output, _Failure):
                refusal = Refusal.of(item, output.code, output.message)
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
            batch = self._runner.prepare([i.tensor for i in items])
            launched = self._runner.launch(batch, [i.meta.params for i in items])
            outputs = self._runner.finish(launched)
            _keep_images(items, launched)
            return outputs
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()  # give the halves the memory the failed batch held
            if len(items) == 1:
                return [_Failure(ErrorCode.out_of_memory, f"out of memory even alone: {exc}")]
        except ContractError as exc:  # e.g. a JPEG that only fails when decoded in batch
            if len(items) == 1:
                return [_Failure(exc.code, str(exc))]
        except Exception as exc:
            broken = device_error(self._runner.device)
            if broken is not None:
                raise DeviceLost(
                    f"the model's device {self._runner.device} failed ({broken!r}) "
                    f"on a batch of {len(items)}"
                ) from exc
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


def device_error(device: torch.device) -> BaseException | None:
    """Why ``device`` no longer runs work, or ``None`` while it does. After a batch fails:
    an input the model refuses leaves the device working, a sticky CUDA error does not
    (the synchronisation raises it again, and so would every later batch)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).cpu()
    except Exception as exc:
        return exc
    return None


class _Failure:
    __slots__ = ("code", "message")

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code = code
        self.message = message


def _live(items: list[Item]) -> tuple[list[Item], list[Refusal]]:
    """The items whose deadline has not passed, and ``expired`` refusals for the rest
    (a batch may have waited behind the running one past some deadlines)."""
    now = time.monotonic()
    if not any(i.deadline_at is not None and i.deadline_at <= now for i in items):
        return items, []
    live = [i for i in items if i.deadline_at is None or i.deadline_at > now]
    return live, [
        expired_refusal(i) for i in items if i.deadline_at is not None and i.deadline_at <= now
    ]


def expired_refusal(item: Item) -> Refusal:
    """The deadline passed before the model ran: ``expired``, no dead letter."""
    deadline = item.meta.deadline
    when = deadline.isoformat() if deadline is not None else "(max age)"
    message = f"deadline {when} passed before inference"
    return Refusal.of(item, ErrorCode.expired, message, dead_letter=False)


def superseded_refusal(item: Item) -> Refusal:
    """A newer frame of the item's stream was waiting: ``superseded``, no dead letter."""
    meta = item.meta
    frame = "a frame" if meta.seq is None else f"frame {meta.seq}"
    message = (
        f"{frame} of stream {meta.stream} was superseded by a newer frame of the stream "
        "before inference (freshest-frame mode)"
    )
    return Refusal.of(item, ErrorCode.superseded, message, dead_letter=False)


def _keep_images(items: Sequence[Item], launched: Launched) -> None:
    """Each item's image as the model saw it, where the runner kept them (a next stage
    cuts its crops from these, not from the payload decoded again)."""
    if launched.images is not None:
        for item, image in zip(items, launched.images, strict=True):
            item.tensor = image
