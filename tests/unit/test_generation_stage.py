"""The model stage of a generation engine (``workers.generation.stage``) with an engine
double that the test steps by hand: places in the engine, stop strings, deadlines while
a request runs, engine gauges, and a dead engine thread."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from producers.testing import until
from schemas import ErrorCode
from tests.fakes import request_item
from workers.generation.engine import Plan
from workers.generation.loading import StreamOptions
from workers.generation.requests import Prompt, Sampling
from workers.generation.stage import Generating, GenerationRunner
from workers.observe.metrics import GenerationMetrics
from workers.types import Item, Outcome

EOS = 1


@dataclass
class SteppedEngine:
    """Takes runs and reports what the test says, when it says."""

    options: Any
    eos: list[int] = field(default_factory=lambda: [EOS])
    runs: dict[str, Any] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    running: bool = True
    plan: Plan = field(default_factory=lambda: Plan("cpu", 1000, 10, 16, 64, 2, 10, None, None))

    def start(self) -> None: ...
    def stop(self) -> None: ...

    def alive(self) -> bool:
        return self.running

    def add(self, request_id: str, prompt: Prompt, on_output: Any) -> str:
        run = f"{request_id}#{len(self.runs)}"
        self.runs[run] = on_output
        return run

    def cancel(self, run: str) -> None:
        self.cancelled.append(run)

    def sequences(self) -> tuple[int, int]:
        return len(self.runs) - len(self.cancelled), 0

    def kv_bytes_in_use(self) -> int:
        return 100 * (len(self.runs) - len(self.cancelled))

    def step(self, run: str, tokens: list[int], done: bool = False) -> None:
        status = RequestStatus.FINISHED if done else RequestStatus.DECODING
        stamps = [1.0 + 0.1 * n for n in range(len(tokens))]
        self.runs[run](
            GenerationOutput(run, [5], tokens, status=status, created_time=0.5, timestamps=stamps)
        )


@dataclass
class Options:
    max_sequences: int = 2


@dataclass
class FakeGenerator:
    engine: SteppedEngine
    streams: StreamOptions = field(default_factory=lambda: StreamOptions(cancel_poll_ms=1))
    device: str = "cpu"

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def stage(outcomes: list[Outcome]) -> tuple[Generating, SteppedEngine, CollectorRegistry]:
    engine = SteppedEngine(Options())
    registry = CollectorRegistry()
    runner = GenerationRunner(FakeGenerator(engine))  # type: ignore[arg-type]  # a double
    return Generating(runner, outcomes.append, GenerationMetrics(registry, "m")), engine, registry


def item(request_id: str, stop: tuple[str, ...] = (), deadline_s: float | None = None) -> Item:
    it = request_item(request_id)
    it.tensor = Prompt([5], 8, Sampling(), stop)
    it.deadline_at = None if deadline_s is None else time.monotonic() + deadline_s
    return it


async def test_requests_take_the_engines_places_and_finish_out_of_order() -> None:
    outcomes: list[Outcome] = []
    generating, engine, _ = stage(outcomes)
    for name in ("a", "b"):
        await generating.wait_for_slot()
        generating.submit([item(name)])
    third = asyncio.ensure_future(generating.wait_for_slot())
    await until(lambda: len(engine.runs) == 2, "both joined", 5)
    assert not third.done()  # the engine is full
    run_a, run_b = list(engine.runs)
    engine.step(run_b, [ord("h"), ord("i"), EOS], done=True)
    await asyncio.wait_for(third, 5)  # b left: a place is free
    (answer,) = outcomes
    assert answer.answered[0].meta.id == "b"
    assert answer.outputs[0]["text"] == "hi"
    assert answer.outputs[0]["finish_reason"] == "stop"
    assert answer.outputs[0]["completion_tokens"] == 3
    assert answer.outputs[0]["time_to_first_token_ms"] == 500.0
    engine.step(run_a, [ord("x")] * 8, done=True)
    assert outcomes[1].outputs[0]["finish_reason"] == "length"
    generating.release_slot()
    await asyncio.wait_for(generating.wait_idle(), 5)


async def test_a_stop_string_ends_the_run_in_the_engine_and_is_cut() -> None:
    outcomes: list[Outcome] = []
    generating, engine, _ = stage(outcomes)
    await generating.wait_for_slot()
    generating.submit([item("s", stop=("##",))])
    await until(lambda: bool(engine.runs), "joined", 5)
    (run,) = engine.runs
    engine.step(run, [ord(c) for c in "ok#"])
    assert not outcomes
    engine.step(run, [ord(c) for c in "ok##more"])
    assert engine.cancelled == [run]
    assert outcomes[0].outputs[0]["text"] == "ok"
    assert outcomes[0].outputs[0]["stop"] == "##"
    engine.step(run, [ord(c) for c in "ok##more!"])  # a step past the stop: ignored
    assert len(outcomes) == 1


async def test_a_deadline_that_passes_while_generating_stops_it_expired() -> None:
    outcomes: list[Outcome] = []
    generating, engine, registry = stage(outcomes)
    await generating.wait_for_slot()
    generating.submit([item("d", deadline_s=0.2)])
    await until(lambda: bool(engine.runs), "joined", 5)
    (run,) = engine.runs
    engine.step(run, [ord("a")])
    await until(lambda: bool(outcomes), "the request expired", 10)
    (refusal,) = outcomes[0].refused
    assert refusal.code is ErrorCode.expired
    assert "during generation (after 1 new tokens)" in refusal.message
    assert engine.cancelled == [run]
    assert (
        registry.get_sample_value(
            "conveyor_generation_tokens_total", {"model": "m", "kind": "output"}
        )
        == 1
    )
    capacity = registry.get_sample_value(
        "conveyor_generation_kv_cache_bytes", {"model": "m", "use": "capacity"}
    )
    assert capacity == 1000


async def test_a_dead_engine_thread_is_a_lost_device() -> None:
    outcomes: list[Outcome] = []
    generating, engine, _ = stage(outcomes)
    await generating.wait_for_slot()
    generating.submit([item("x")])
    await until(lambda: bool(engine.runs), "joined", 5)
    engine.running = False
    await until(lambda: bool(outcomes), "the stage gave up", 10)
    assert outcomes[0].lost is not None
