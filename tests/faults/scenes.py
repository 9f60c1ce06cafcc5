"""The shape of a fault scenario, and the steps its rows are written in.

A ``Scenario`` is one row of the table in test_faults.py: a set-up (topics,
requests, workers), a fault, a recovery, and what its tally must show beyond
``check`` (nothing lost, one visible answer per id). ``play`` runs one on a
``Scene``: the test's model, services, workers and requests. Each column is a
``Step``; ``steps(...)`` runs several in order, and the constructors here
(``backlog``, ``start``, ``answered``, ``drain``, ``stop_service``, ...) build
the common ones.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    Tally,
    WorkerProcess,
    count_results,
    produce,
    read_results,
    until,
    until_answered,
)
from schemas import ContentType, ModelTopics, OutgoingRecord, encode_request, topics_for
from tests.harness import LocalService, check, check_exactly_once, setup_model, tally_scenario

EXACTLY_ONCE = ("--delivery", "exactly-once")


@dataclass
class Scene:
    """One scenario's run: where it runs, its workers, and its requests."""

    scenario: Scenario
    model: str
    bootstrap: str  # the private broker's when the scenario has one
    redis_url: str  # the private Redis's when the scenario has one
    workers: Fleet
    digits: Sequence[tuple[bytes, int]]
    service: LocalService | None  # the private service that the fault stops
    s3_options: dict[str, str] = field(default_factory=dict)  # S3Settings fields, with S3
    records: list[OutgoingRecord] = field(default_factory=list)  # in the order produced
    ids: list[str] = field(default_factory=list)  # what the tally counts
    sent: int = 0  # how many of ``records`` are produced so far
    measured: dict[str, float] = field(default_factory=dict)  # by a step, for ``expect``
    facts: list[bool] = field(default_factory=list)  # the same, yes or no

    @property
    def topics(self) -> ModelTopics:
        return topics_for(self.model)

    def worker(self, n: int) -> WorkerProcess:
        """The ``n``-th worker started (negative: from the newest back)."""
        return self.workers.started[n]

    def private(self) -> LocalService:
        assert self.service is not None, "this scenario has no service of its own"
        return self.service

    async def produce_until(self, upto: int | None = None) -> None:
        """Produce the next records, up to index ``upto`` (None: all the rest)."""
        end = len(self.records) if upto is None else upto
        await produce(self.bootstrap, self.topics.requests, self.records[self.sent : end])
        self.sent = max(self.sent, end)

    async def answered_now(self) -> int:
        return await count_results(self.redis_url, self.ids)


Step = Callable[[Scene], Awaitable[None]]
Expectation = Callable[[Scene, Tally], Awaitable[None]]


async def nothing(scene: Scene) -> None:
    """No step: the fault is in the requests or the model themselves."""


async def nothing_more(scene: Scene, tally: Tally) -> None:
    """No more than ``check``."""


@dataclass(frozen=True)
class Scenario:
    """One row of the fault table."""

    name: str  # its row in the fault table
    setup: Step  # topics, requests, workers, up to the moment of the fault
    fault: Step
    recovery: Step = nothing
    expect: Expectation = nothing_more  # beyond lost 0 and duplicate-visible 0
    service: str | None = None  # "redis", "kafka" or "s3": a private one, which the fault stops
    delivery: str = "at-least-once"  # or "exactly-once": tallied as a read_committed reader
    tally_timeout_s: float = 120
    timeout_s: float = 240  # the whole test's


async def play(scene: Scene) -> Tally:
    """Set up, inject the fault, recover; then tally, check and add the row to the table."""
    scenario = scene.scenario
    await scenario.setup(scene)
    await scenario.fault(scene)
    await scenario.recovery(scene)
    exactly_once = scenario.delivery == "exactly-once"
    counted = await tally_scenario(
        scenario.name,
        scene.bootstrap,
        scene.redis_url,
        scene.model,
        scene.ids,
        scenario.tally_timeout_s,
        "read_committed" if exactly_once else "read_uncommitted",
    )
    (check_exactly_once if exactly_once else check)(counted, scene.workers.logs())
    await scenario.expect(scene, counted)
    return counted


def steps(*parts: Step) -> Step:
    """The steps one after the other."""

    async def run(scene: Scene) -> None:
        for part in parts:
            await part(scene)

    return run


# -- set-up ---------------------------------------------------------------------------------


def backlog(count: int, partitions: int = 3, produced: int | None = None) -> Step:
    """The model's topics and ``count`` digit requests, the first ``produced`` (default:
    all) of them produced now."""

    async def run(scene: Scene) -> None:
        scene.records, scene.ids = await setup_model(
            scene.bootstrap, scene.model, scene.digits, count, partitions
        )
        await scene.produce_until(produced)

    return run


def payload_backlog(
    payloads: Sequence[bytes], content_type: ContentType, partitions: int = 3
) -> Step:
    """The model's topics and one request a payload of ``payloads`` (ids
    ``<model>-<n>``), all produced now: a backlog of a model that takes no digits."""

    async def run(scene: Scene) -> None:
        settings = ClientSettings(kafka_bootstrap=scene.bootstrap)
        await create_model_topics(settings, scene.model, partitions)
        scene.ids = [f"{scene.model}-{n}" for n in range(len(payloads))]
        scene.records = [
            encode_request(
                payload, request_id=request_id, content_type=content_type, source="tests"
            )
            for payload, request_id in zip(payloads, scene.ids, strict=True)
        ]
        await scene.produce_until()

    return run


def start(*flags: str, model: str = "digits", env: dict[str, str] | None = None) -> Step:
    """Start one more worker with these flags (and ``--model``, environment)."""

    async def run(scene: Scene) -> None:
        scene.workers.start(*flags, model=model, env=env or {})

    return run


def answered(count: int, timeout_s: float = 120) -> Step:
    """Wait until ``count`` requests are answered."""

    async def run(scene: Scene) -> None:
        await until_answered(scene.redis_url, scene.ids, count, timeout_s)

    return run


def answered_more(count: int) -> Step:
    """Wait until ``count`` more requests than now are answered."""

    async def run(scene: Scene) -> None:
        await answered(await scene.answered_now() + count)(scene)

    return run


def produce_rest(upto: int | None = None) -> Step:
    """Produce the requests not sent yet (up to index ``upto``)."""

    async def run(scene: Scene) -> None:
        await scene.produce_until(upto)

    return run


async def mid_stream(scene: Scene) -> None:
    """The fault must have landed mid-stream: some requests are not answered yet."""
    assert len(await read_results(scene.redis_url, scene.ids)) < len(scene.ids), "too late"


# -- faults and recoveries --------------------------------------------------------------------


def kill(n: int = 0) -> Step:
    """SIGKILL worker ``n``: it dies mid-batch."""

    async def run(scene: Scene) -> None:
        scene.worker(n).kill()

    return run


def drain(n: int = 0) -> Step:
    """SIGTERM worker ``n``; it drains and exits 0."""

    async def run(scene: Scene) -> None:
        scene.worker(n).signal(signal.SIGTERM)
        assert await scene.worker(n).exited(60) == 0, scene.worker(n).log()[-3000:]

    return run


def joined(n: int) -> Step:
    """Wait until worker ``n`` owns partitions."""

    async def run(scene: Scene) -> None:
        worker = scene.worker(n)
        await until(lambda: bool(worker.assigned_partitions()), "it joins", 90, worker.log)

    return run


def outage(seconds: float) -> Step:
    """Let the fault last ``seconds``."""

    async def run(scene: Scene) -> None:
        await asyncio.sleep(seconds)  # the fault itself, not a wait for readiness

    return run


async def stop_service(scene: Scene) -> None:
    await asyncio.to_thread(scene.private().stop)


async def start_service(scene: Scene) -> None:
    await asyncio.to_thread(scene.private().start)


def logs_say(text: str) -> Expectation:
    """The workers' logs contain ``text`` (the fault really reached them)."""

    async def run(scene: Scene, tally: Tally) -> None:
        assert text in scene.workers.logs()

    return run
