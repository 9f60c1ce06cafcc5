"""A worker as a child process of a demo, launched as the tests and benchmarks launch theirs
(``producers.testing``): started, watched, and drained when the demo ends."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import SecretStr

from producers import AsyncClient, ClientError, ContractError
from producers.settings import ClientSettings
from producers.testing import WorkerConfig, WorkerExited, WorkerProcess
from schemas import ContentType, Result, Timings

REPO = Path(__file__).resolve().parents[1]


class DemoError(Exception):
    """The demo could not run to the end; the message says why and where to look."""


class Report(Protocol):
    """What a demo's run ends with: whether it passed."""

    @property
    def passed(self) -> bool: ...


def client_settings(kafka_bootstrap: str | None, redis_url: str | None) -> ClientSettings:
    """The SDK's settings: the addresses given on the command line, else the environment's."""
    given: dict[str, Any] = {}
    if kafka_bootstrap:
        given["kafka_bootstrap"] = kafka_bootstrap
    if redis_url:
        given["redis_url"] = SecretStr(redis_url)
    return ClientSettings(**given)


def exit_status(demo: Coroutine[Any, Any, Report], say: Callable[[str], None]) -> int:
    """Run ``demo``: 0 when its report passed, 1 when not, 2 when it could not run to the
    end (``say`` says why), 130 when interrupted (its worker is stopped first)."""
    try:
        report = asyncio.run(demo)
    except KeyboardInterrupt:
        say("interrupted; the worker was stopped")
        return 130
    except (ClientError, ContractError, DemoError, WorkerExited) as exc:
        say(f"failed: {exc}")
        return 2
    return 0 if report.passed else 1


def worker_config(
    settings: ClientSettings, model_name: str, model: str, device: str, *options: str
) -> WorkerConfig:
    """``conveyor worker --model model`` serving ``model_name`` on the services of ``settings``
    (and its topic prefix), imported from this checkout; its metrics on any free port."""
    return WorkerConfig(
        model_name,
        settings.kafka_bootstrap,
        settings.redis_url.get_secret_value(),
        model=model,
        device=device,
        options=("--topic-prefix", settings.topic_prefix, *options),
        cwd=REPO,
    )


def launch(config: WorkerConfig, log_path: Path) -> WorkerProcess:
    """A worker of ``config`` (start it with ``async with``), its log in ``log_path`` (this
    run's only). It runs in a session of its own, so a Ctrl-C at the terminal reaches only
    the demo, which then stops the worker with one SIGTERM as it leaves: a clean drain.
    ``unless_it_dies`` raises ``producers.testing.WorkerExited`` if it exits early."""
    log_path.unlink(missing_ok=True)
    return WorkerProcess(config, log_path, new_session=True)


async def stream(
    client: AsyncClient,
    model_name: str,
    payloads: Sequence[bytes],
    ids: Sequence[str],
    content_type: ContentType,
    rate: float,
    slice_size: int = 5,
) -> None:
    """One request a payload (``ids[n]`` for ``payloads[n]``), ``rate`` a second, in
    slices of ``slice_size`` sent on a fixed clock (a slice late does not push the rest)."""
    start = time.monotonic()
    for first in range(0, len(ids), slice_size):
        due = start + first / rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        chunk = slice(first, first + slice_size)
        await client.submit_many(
            payloads[chunk], model=model_name, request_ids=ids[chunk], content_type=content_type
        )


async def collect(client: AsyncClient, ids: Sequence[str], wait_s: float) -> dict[str, Result]:
    """The result of each of ``ids``, by id: all within ``wait_s`` (else ``ResultTimeout``)."""
    return {result.id: result async for result in client.wait_many(ids, wait_s)}


def durable_ms(timings: Timings) -> float:
    """When a result was sent to Redis (durable one round trip later)."""
    return timings.finished_ms if timings.published_ms is None else timings.published_ms


def latency_ms(result: Result) -> float | None:
    """From the request's production to its result's write to Redis."""
    timings = result.timings
    return None if timings is None else durable_ms(timings) - timings.produced_ms


def percentile(sorted_values: list[float], percent: int) -> float:
    """Nearest-rank percentile: the smallest value with ``percent``% of values at or below it."""
    if not sorted_values:
        return math.nan
    rank = math.ceil(percent / 100 * len(sorted_values))
    return sorted_values[max(rank, 1) - 1]
