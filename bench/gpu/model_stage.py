"""The ``pipeline`` stage: the worker's model stage, driven without Kafka.

Requests made as the worker's ingest makes them, preprocessed in a thread pool, then
``workers.model.inference``: img/s for each decode path and, on a GPU, the idle time
between forwards from CUDA events. The ``detect`` stage drives its batched rows
through the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench.gpu.config import Config, _event, _rate, decode_paths, load_model
from bench.gpu.corpus import Corpus
from bench.gpu.report import _rounded
from bench.stats import (
    percentile,
)
from schemas import ContentType
from schemas.fastpath import FastMeta
from workers.handlers.base import Handler
from workers.model.inference import Inference
from workers.model.runner import ModelRunner
from workers.offsets import OffsetTracker
from workers.types import Item, Outcome


class ForwardClock:
    """Wraps a forward with CUDA events to measure how long the GPU waits between batches."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._forward = forward
        self.events: list[tuple[Any, Any]] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        start, end = _event(), _event()
        start.record()
        out = self._forward(batch)
        end.record()
        self.events.append((start, end))
        return out

    def summary(self) -> dict[str, float]:
        """Idle gaps (ms) between one forward's end and the next one's start, and the
        share of the span the model was busy."""
        torch.cuda.synchronize()
        gaps = [
            self.events[n][1].elapsed_time(self.events[n + 1][0])
            for n in range(len(self.events) - 1)
        ]
        busy = sum(s.elapsed_time(e) for s, e in self.events)
        span = self.events[0][0].elapsed_time(self.events[-1][1]) if self.events else math.nan
        return {
            "forwards": len(self.events),
            "idle_gap_p50_ms": percentile(gaps, 50),
            "idle_gap_p99_ms": percentile(gaps, 99),
            "model_busy_share": busy / span if span else math.nan,
        }


def stage_pipeline(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    """The worker's model stage without Kafka: preprocess in a thread pool as the worker
    does, then ``workers.model.inference.Inference`` (prepare ─▶ launch ─▶ finish on a GPU);
    img/s, and the GPU's idle time between forwards (CUDA events)."""
    out: dict[str, Any] = {}
    for decode in decode_paths(cfg):
        handler = load_model(cfg, "float16" if cfg.device.type == "cuda" else "float32", decode)
        clock = ForwardClock(handler.forward) if cfg.device.type == "cuda" else None
        if clock is not None:
            handler.forward = clock  # type: ignore[method-assign]
        runner = ModelRunner(handler, cfg.device)
        runner.warm_up([cfg.max_batch])
        for corpus in corpora:
            if clock is not None:
                clock.events.clear()
            rate = asyncio.run(_drive_pipeline(handler, runner, corpus.take(cfg.runner_count), cfg))
            row: dict[str, Any] = {"img_s": rate}
            if clock is not None:
                row.update(clock.summary())
            out[f"{decode}-decode {corpus.name}"] = row
            print(
                f"  pipeline {decode}-decode {corpus.name}: {json.dumps(_rounded(row))}",
                flush=True,
            )
    return out


async def _drive_pipeline(
    handler: Handler, runner: ModelRunner, payloads: Sequence[bytes], cfg: Config
) -> float:
    answered = 0

    def on_done(outcome: Outcome) -> None:
        nonlocal answered
        answered += len(outcome.answered)

    inference = Inference(runner, on_done)
    loop = asyncio.get_running_loop()
    chunks = [payloads[n : n + cfg.max_batch] for n in range(0, len(payloads), cfg.max_batch)]
    try:
        with ThreadPoolExecutor(cfg.threads) as pool:
            start = time.perf_counter()
            ready = [loop.run_in_executor(pool, _items, handler, chunk) for chunk in chunks]
            for future in ready:
                batch = await future
                await inference.wait_for_slot()
                inference.submit(batch)
            await inference.wait_idle()
            elapsed = time.perf_counter() - start
    finally:
        inference.close()
    if answered != len(payloads):
        raise RuntimeError(f"the pipeline answered {answered} of {len(payloads)} images")
    return _rate(len(payloads), elapsed)


def _detect_pipeline(
    cfg: Config,
    handler: Handler,
    runner: ModelRunner,
    payloads: Sequence[bytes],
    batch: int,
    threads: int,
) -> float:
    """``_drive_pipeline`` for the detect stage, with its own batch size and threads."""
    sized = dataclasses.replace(cfg, max_batch=batch, threads=threads)
    return asyncio.run(_drive_pipeline(handler, runner, payloads, sized))


def _items(handler: Handler, payloads: Sequence[bytes]) -> list[Item]:
    """Requests as the worker's ingest makes them (no Kafka record behind them)."""
    span = OffsetTracker[tuple[str, int]]().open(("bench", 0), 0, len(payloads) - 1, len(payloads))
    now_ms = time.time() * 1000.0
    items = []
    for n, payload in enumerate(payloads):
        meta = FastMeta(f"b{n}", ContentType.JPEG, {}, None, None, None, None, None)
        tensor = handler.preprocess(payload, ContentType.JPEG, {})
        items.append(Item(None, span, meta, now_ms, None, tensor))  # type: ignore[arg-type]
    return items
