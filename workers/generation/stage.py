"""The model stage of a generation model: requests join the running engine one by one.

The pipeline's batch loop hands over what its lane batcher closes (a batch of one
request each: ``max_batch_size`` is 1 for a generation model, the engine does the
batching), after ``wait_for_slot``: at most ``max_sequences`` requests are in the
engine at a time, so the lanes' weights decide which waiting request joins next.

Each request, as it joins: its deadline is checked, the admission (cancellation,
status) looks at it, a ``start`` event goes to its stream, and the engine takes it.
Then, at every step, the engine's output for it goes through the output processor
(``workers.generation.outputs``): its next chunk to the stream, and once it is done
(end of sequence, a stop string, ``max_new_tokens``) one ``Outcome`` with its final
output to the publish stage, which writes the result document as for every model
(first final wins) and commits its offset once the result is durable, in whatever
order requests finish.

A watch task, every ``cancel_poll_ms`` while requests run, sets the engine gauges,
stops requests whose deadline passed (``expired``) and, with ``--cancellation``,
those whose ``conveyor:cancel:{<id>}`` key appeared (``cancelled``): the engine drops
them at its next step and frees their cache blocks. An engine whose thread died
fails the worker as a lost device does (its records stay uncommitted for another).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput

from schemas import ErrorCode
from workers.generation.engine import FAILED
from workers.generation.loading import Generator, prompt_of
from workers.generation.outputs import LENGTH, STOP, Detokenized, final
from workers.model.inference import expired_refusal
from workers.observe.metrics import GenerationMetrics
from workers.publish.streams import TokenStreams
from workers.types import AdmissionCheck, BatchTiming, DeviceLost, Item, Outcome, Refusal

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GenerationRunner:
    """A generation model as the pipeline takes it (in place of a ``ModelRunner``)."""

    handler: Generator
    streams: TokenStreams | None = None
    """Where chunks go; set by the worker once its Redis is open (none: no streams)."""
    cancellation: bool = False
    """Look for cancel keys while requests run (``--cancellation``)."""

    @property
    def device(self) -> torch.device:
        return torch.device(self.handler.device)


@dataclass(slots=True, eq=False)
class _Run:
    """One request in the engine."""

    item: Item
    run: str
    text: Detokenized
    prompt_tokens: int
    start_ms: float  # epoch ms: when it joined the engine
    peers: int  # requests in the engine as it joined, itself included
    return_token_ids: bool
    created_s: float = 0.0  # the engine's clock when it joined
    timestamps: list[float] = field(default_factory=list)


class Generating:
    """Feeds one engine and turns its outputs into outcomes (``workers.types.ModelStage``)."""

    def __init__(
        self,
        runner: GenerationRunner,
        on_done: Callable[[Outcome], None],
        metrics: GenerationMetrics,
        *,
        admission: AdmissionCheck | None = None,
    ) -> None:
        self._runner = runner
        self._generator = runner.handler
        self._engine = runner.handler.engine
        self._streams = runner.streams
        self._on_done = on_done
        self._metrics = metrics
        self._admission = admission
        self._capacity = self._engine.options.max_sequences
        self._held = 0  # slots taken: requests joining or in the engine
        self._freed = asyncio.Event()
        self._runs: dict[str, _Run] = {}
        self._joining = 0
        self._tasks: set[asyncio.Task[None]] = set()  # joins under way (held: not collected)
        self._idle = asyncio.Event()
        self._idle.set()
        self._watch: asyncio.Task[None] | None = None
        self._poll_s = runner.handler.streams.cancel_poll_ms / 1000.0
        self.seconds_per_item: float | None = None  # the in-flight bound is the engine's size
        self._engine.start()

    @property
    def capacity(self) -> int:
        """Requests in the engine at once, at most."""
        return self._capacity

    async def wait_for_slot(self) -> None:
        while self._held >= self._capacity:
            self._freed.clear()
            await self._freed.wait()
        self._held += 1

    def takes_partial(self) -> bool:
        return True  # a request never waits for others to join with it

    def release_slot(self) -> None:
        self._held -= 1
        self._freed.set()

    def submit(self, items: list[Item]) -> None:
        self._held += len(items) - 1  # a batch of more than one, if the settings make one
        self._joining += 1
        self._idle.clear()
        loop = asyncio.get_running_loop()
        joining = loop.create_task(self._join(items))
        self._tasks.add(joining)
        joining.add_done_callback(self._tasks.discard)
        if self._watch is None or self._watch.done():
            self._watch = loop.create_task(self._watch_loop())

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._engine.stop()

    # -- joining ---------------------------------------------------------------------------

    async def _join(self, items: list[Item]) -> None:
        try:
            refused: list[Refusal] = []
            now = time.monotonic()
            live = []
            for item in items:
                if item.deadline_at is not None and item.deadline_at <= now:
                    refused.append(expired_refusal(item))
                else:
                    live.append(item)
            if live and self._admission is not None:
                admitted = await self._admission.admit(live)
                live, refused = admitted.items, refused + admitted.cancelled
            if refused:
                self._release(len(refused))
                self._on_done(Outcome(refused=refused))
            if live and not self._engine.alive():
                raise DeviceLost("the generation engine's thread stopped")
            for item in live:
                self._add(item)
        except DeviceLost as exc:
            log.error("%s; stopping without answering its requests", exc)
            self._on_done(Outcome(lost=exc))
        except Exception as exc:  # a bug here must not lose the requests
            log.error("generation stage failed to start %d requests", len(items), exc_info=exc)
            gone = [i for i in items if not any(r.item is i for r in self._runs.values())]
            self._release(len(gone))
            self._on_done(
                Outcome(
                    refused=[
                        Refusal.of(i, ErrorCode.internal, f"worker failed: {exc!r}") for i in gone
                    ]
                )
            )
        finally:
            self._joining -= 1
            self._check_idle()

    def _add(self, item: Item) -> None:
        prompt = prompt_of(item.tensor)
        decode = self._generator.decode
        text = Detokenized(decode, prompt.stop, self._engine.eos)
        started = time.time() * 1000.0
        run = self._engine.add(item.meta.id, prompt, self._output)
        state = _Run(
            item,
            run,
            text,
            len(prompt.token_ids),
            started,
            len(self._runs) + 1,
            prompt.return_token_ids,
        )
        self._runs[run] = state
        if self._streams is not None:
            self._streams.start(item.meta.id, run, item.attempt)

    # -- each step's output ------------------------------------------------------------------

    def _output(self, output: GenerationOutput) -> None:
        """On the event loop: the engine's state of one run after a step."""
        state = self._runs.get(output.request_id)
        if state is None:  # stopped here already (cancelled, expired, a stop string)
            return
        state.created_s = output.created_time
        if output.timestamps is not None:
            state.timestamps = list(output.timestamps)
        if output.status == FAILED:
            self._stop(state, ErrorCode.model_error, f"the model failed: {output.error}")
            return
        step = state.text.update(output.generated_tokens)
        self._chunk(state, step.chunk)
        if step.stopped is not None:
            self._engine.cancel(state.run)
            self._answer(state, STOP)
        elif output.is_finished():
            self._chunk(state, state.text.finish())
            tokens = state.text.tokens
            ended = bool(tokens) and tokens[-1] in self._engine.eos
            self._answer(state, STOP if ended else LENGTH)

    def _chunk(self, state: _Run, text: str) -> None:
        if text and self._streams is not None:
            self._streams.chunk(state.item.meta.id, state.run, text)

    def _answer(self, state: _Run, reason: str) -> None:
        self._forget(state)
        output = final(
            state.text,
            prompt_tokens=state.prompt_tokens,
            finish_reason=reason,
            created_s=state.created_s,
            timestamps=state.timestamps,
            attempt=state.item.attempt,
            token_ids=state.return_token_ids,
        )
        if self._streams is not None:
            self._streams.end(state.item.meta.id, state.run, reason)
        finished_ms = time.time() * 1000.0
        timing = BatchTiming(state.start_ms, finished_ms, finished_ms - state.start_ms, state.peers)
        self._on_done(Outcome([state.item], [output], timing))

    def _stop(
        self, state: _Run, code: ErrorCode, message: str, *, refusal: Refusal | None = None
    ) -> None:
        """End ``state`` without an answer: cancelled, expired, or the model failed."""
        self._engine.cancel(state.run)
        self._forget(state)
        made = len(state.text.tokens)
        if refusal is None:
            refusal = Refusal.of(
                state.item,
                code,
                f"{message} (after {made} new tokens)",
                dead_letter=code == ErrorCode.model_error,  # a cancel is no failure
            )
        if self._streams is not None:
            self._streams.error(state.item.meta.id, state.run, refusal.code.value, refusal.message)
        self._on_done(Outcome(refused=[refusal]))

    def _forget(self, state: _Run) -> None:
        del self._runs[state.run]
        stamps = state.timestamps
        ttft = stamps[0] - state.created_s if stamps else None
        tbt = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        self._metrics.finished(state.prompt_tokens, len(state.text.tokens), ttft, tbt)
        self._release(1)
        self._check_idle()

    def _release(self, count: int) -> None:
        if count:
            self._held -= count
            self._freed.set()

    def _check_idle(self) -> None:
        if not self._runs and self._joining == 0:
            self._idle.set()

    # -- the watch: gauges, deadlines, cancellations -----------------------------------------

    async def _watch_loop(self) -> None:
        while self._runs or self._joining:
            await asyncio.sleep(self._poll_s)
            self._gauges()
            if self._runs and not self._engine.alive():
                exc = DeviceLost("the generation engine's thread stopped")
                log.error("%s with %d requests running", exc, len(self._runs))
                self._runs.clear()
                self._on_done(Outcome(lost=exc))
                return
            self._expire()
            if self._runner.cancellation and self._streams is not None and self._runs:
                await self._cancelled()
        self._gauges()

    def _gauges(self) -> None:
        running, waiting = self._engine.sequences()
        plan = self._engine.plan
        self._metrics.engine(running, waiting, self._engine.kv_bytes_in_use(), plan.kv_cache_bytes)

    def _expire(self) -> None:
        now = time.monotonic()
        for state in list(self._runs.values()):
            deadline = state.item.deadline_at
            if deadline is not None and deadline <= now:
                refusal = expired_refusal(state.item)
                refusal.message = (
                    f"{refusal.message.replace('before inference', 'during generation')} "
                    f"(after {len(state.text.tokens)} new tokens)"
                )
                self._stop(state, ErrorCode.expired, "", refusal=refusal)

    async def _cancelled(self) -> None:
        assert self._streams is not None
        states = list(self._runs.values())
        try:
            found = await self._streams.cancelled([state.item.meta.id for state in states])
        except Exception as exc:  # fail open, as the admission does: the request runs on
            log.warning("cancellation check of %d running requests failed: %r", len(states), exc)
            return
        for state, exists in zip(states, found, strict=True):
            if exists and state.run in self._runs:
                self._stop(
                    state,
                    ErrorCode.cancelled,
                    "cancelled during generation (its conveyor:cancel key was set)",
                )
