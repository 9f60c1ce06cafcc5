"""A host supervisor's state: its models, their processes, and what it is doing.

``workers.fleet.supervisor`` keeps the processes; ``workers.fleet.starting`` starts them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from workers.config.worker import WorkerSettings
from workers.exits import EXIT_CONFIG
from workers.fleet import plan
from workers.fleet.children import Child
from workers.fleet.exposition import FleetMetrics
from workers.fleet.failing import StartFailures
from workers.fleet.forkserver import ForkServer
from workers.fleet.host import Host
from workers.fleet.mps import MpsServer

log = logging.getLogger("conveyor.fleet")


@dataclass
class Model:
    """One model of the host: its settings, its processes, and why it does not serve
    (its first process did not load, or its topics cannot be served)."""

    settings: WorkerSettings
    slots: list[plan.Slot]
    children: list[Child] = field(default_factory=list)
    failed: str = ""
    process_mb: float | None = None  # one process's memory on its card, once measured
    loaded: bool = False  # a process of it loaded the model: a later one's failure is its own

    @property
    def name(self) -> str:
        return self.settings.served_name


@dataclass
class State:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    failure: int | None = None  # the status the host stops with, when a process ended it
    mps: MpsServer | None = None
    forks: ForkServer | None = None
    models: dict[str, Model] = field(default_factory=dict)
    host: Host | None = None  # the host file, when the host serves one
    children: list[Child] = field(default_factory=list)  # every model's, in order
    keepers: list[asyncio.Task[None]] = field(default_factory=list)
    removed: set[Child] = field(default_factory=set)  # their model left the host file
    roll: asyncio.Event = field(default_factory=asyncio.Event)  # SIGHUP: restart in turn
    rolling: set[Child] = field(default_factory=set)  # stopped on purpose, to start at once
    failures: StartFailures = field(default_factory=lambda: StartFailures({}))
    retired: set[Child] = field(default_factory=set)  # failed at start: not started again
    retrying: dict[str, str] = field(default_factory=dict)  # process → its failed starts so far
    metrics: FleetMetrics | None = None
    baseline_mb: dict[int, int] = field(default_factory=dict)  # each card's use before any model


def sync(state: State) -> None:
    """``state.children`` after the models' processes changed."""
    state.children = [c for model in state.models.values() for c in model.children]


def left_out(state: State, model: Model, why: str) -> None:
    """A host file's model that cannot serve: its processes stop for good, the others
    serve on; the host stops when none is left."""
    model.failed = why
    state.retired.update(model.children)
    for child in model.children:
        if child.running:
            child.signal(signal.SIGTERM)
    log.error(
        "model %s cannot serve, the host's other models serve on: %s. Fix the host file "
        "(%s), then SIGHUP the supervisor to start it",
        model.name,
        why,
        state.host.path if state.host is not None else "--config-file",
    )
    if all(m.failed for m in state.models.values()):
        log.error("no model of this host can serve: stopping the host")
        state.failure = state.failure or EXIT_CONFIG
        state.stop.set()
