"""One ``/metrics`` for the host: every process's metrics, merged, and the supervisor's own.

Each worker process keeps its metrics in its own registry and serves them on a
private loopback port. A scrape of the host's port reads them all (concurrently),
adds a ``process`` label (the process's name, ``<host>-<card>-<n>``) to every
sample so that series of different processes never collide, and serves the union
as one exposition: ``sum by (model) (rate(conveyor_requests_total[1m]))`` over the
host's port is the host's throughput, as over separate scrapes it would be the
sum of the processes'. A process that does not answer (starting, restarting) is
left out of that scrape; counters of a restarted process start again from zero,
as Prometheus expects of any restart.

The supervisor's own metrics: ``conveyor_fleet_processes`` (the processes the
host should run, by state: ``wanted``, ``running``, ``ready``) and
``conveyor_fleet_restarts_total`` (processes started again after an exit),
``conveyor_fleet_failed_processes`` (processes no longer started: they failed at start
the same way again and again, ``workers.fleet.failing``) and ``conveyor_fleet_cards``
(the host's cards, the CPU counting as one, by state: ``serving`` or ``failed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Scrape = Callable[[], Awaitable[str | None]]
"""Reads one process's exposition (None while it does not answer)."""

LABEL = "process"


class FleetMetrics:
    """The host's ``/metrics``: what ``HealthServer`` serves for a supervisor."""

    content_type: ClassVar[str] = CONTENT_TYPE_LATEST

    def __init__(self, model: str, sources: Callable[[], Sequence[tuple[str, Scrape]]]) -> None:
        """``sources``: the processes' names and how to read each, as they are now."""
        self._sources = sources
        self._registry = CollectorRegistry(auto_describe=False)
        self._processes = Gauge(
            "conveyor_fleet_processes",
            "Worker processes of this host, by state: wanted, running, ready.",
            ["model", "state"],
            registry=self._registry,
        ).labels
        self._failed = Gauge(
            "conveyor_fleet_failed_processes",
            "Worker processes not started again: they failed at start the same way "
            "again and again (the log and /readyz say why).",
            ["model"],
            registry=self._registry,
        ).labels
        self._cards = Gauge(
            "conveyor_fleet_cards",
            "This host's cards (the CPU counts as one), by state: serving, or failed (every "
            "process of it failed at start and is not started again).",
            ["model", "state"],
            registry=self._registry,
        ).labels
        self._restarts = Counter(
            "conveyor_fleet_restarts_total",
            "Worker processes started again after they exited.",
            ["model"],
            registry=self._registry,
        ).labels(model)
        self._ready = Gauge(
            "conveyor_fleet_ready", "1 when every process is ready.", ["model"],
            registry=self._registry,
        ).labels(model)  # fmt: skip
        self._lag = Gauge(
            "conveyor_fleet_loop_lag_seconds",
            "How late the supervisor's event loop woke for its last heartbeat.",
            ["model"],
            registry=self._registry,
        ).labels(model)
        self._model = model

    def set_processes(
        self, wanted: int, running: int, ready: int, failed: int = 0, model: str | None = None
    ) -> None:
        """One model's processes (the host's first model by default)."""
        model = model or self._model
        for state, count in (("wanted", wanted), ("running", running), ("ready", ready)):
            self._processes(model, state).set(count)
        self._failed(model).set(failed)

    def set_cards(self, serving: int, failed: int) -> None:
        for state, count in (("serving", serving), ("failed", failed)):
            self._cards(self._model, state).set(count)

    def restarted(self) -> None:
        self._restarts.inc()

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def set_loop_lag(self, seconds: float) -> None:
        self._lag.set(seconds)

    async def render(self) -> bytes:
        sources = list(self._sources())
        texts = await asyncio.gather(*(scrape() for _, scrape in sources))
        merged = merge((name, text) for (name, _), text in zip(sources, texts, strict=True))
        return generate_latest(self._registry) + merged


def merge(expositions: Iterable[tuple[str, str | None]]) -> bytes:
    """The union of processes' expositions, each sample labelled with its process's name."""
    families: dict[str, Metric] = {}
    for name, text in expositions:
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(_labelled(family.samples, name))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _labelled(samples: Iterable[Sample], process: str) -> list[Sample]:
    return [s._replace(labels={**s.labels, LABEL: process}) for s in samples]


class _Fixed:
    """A collector that hands out families made elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
