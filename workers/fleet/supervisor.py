"""The supervisor: one ``conveyor worker`` runs a host's worker processes at full speed.

A host serves one model, or the models of a host file (``workers.config.host``): each
has its own processes, topics and group, and the steps below apply to each in turn,
under one fork server, one MPS server and one health port (``/readyz?model=NAME`` for
one model). A host file's model that cannot serve is left out, named in ``/readyz``,
while the others serve; SIGHUP rereads the file and does what changed.

On a GPU host one worker process leaves its card idle part of the time (its event
loop fetches, parses and publishes for every batch); several processes per card
under an MPS server fill it. The supervisor assembles that from the one command:

1. **plan**: the cards (``--gpus``), the processes per card (``--processes``; for
   ``auto`` see ``workers.fleet.plan``), each with a stable name
   ``<host>-<card>-<n>`` used as its static group membership and worker id;
2. **check**: the model's topics exist, and the request topics have a partition for
   every process of this host and every other member of the group it can see (a
   process without one would never be ready). With ``auto`` a host that has fewer
   partitions than planned processes runs fewer, and says how to add partitions;
   an explicit count it cannot run is exit 3 with the same advice;
3. **MPS**: an MPS server for the cards with several processes (``workers.fleet.mps``);
4. **start** (``workers.fleet.starting``): the processes are forked by the host's fork
   server, which imported torch, torchvision and Inductor's cache once
   (``workers.fleet.forkserver``); one process first, which compiles the model into
   the host's compile cache (``workers.model.compile_cache``); once it has loaded and warmed up, its
   memory on the card is measured (``auto`` fits the count to it) and the others
   start together, loading what it compiled (and the weights it downloaded);
5. **watch**: ``/metrics`` on ``--metrics-port`` merges every process's
   (``workers.fleet.exposition``), ``/readyz`` is 200 when every process is ready,
   ``/healthz`` while the supervisor runs. A process that exits is started again
   with backoff (1 s doubling to 30 s, back to 1 s after a minute up), except after
   a status that restarting cannot change (settings, configuration, install,
   environment: ``workers.exits.PERMANENT``), which stops the host with that status;
   a device fault (status 7: under MPS one client's fault ends its card's clients)
   restarts every process of that card. A process that fails at start the same way
   again and again, or a card whose processes all do, is not started again
   (``workers.fleet.failing``): the log says why once, ``/readyz`` names it (the host
   is unready: it serves, short of what it should), and the metrics count it; when
   no card is left, the host exits ``EXIT_NO_CARD``. A model's first process counts
   its failed starts the same way, and gives its place to the next process, or card
   (``workers.fleet.starting``); a model error (status 2) of a process after another
   has loaded that model is that process's failed start, not a reason to stop;
6. **roll**: SIGHUP restarts the processes one a card at a time, each ready before its
   card's next one stops, each reading its settings and model afresh: a new model version without
   downtime (docs/operations.md "Changing the model");
7. **stop**: SIGTERM or SIGINT is passed to every process, which drains and commits;
   the supervisor waits for all of them, quits its MPS server and exits 0. A second
   signal kills them at once (at-least-once delivery still holds: nothing
   unanswered was committed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from pydantic_settings import SettingsError

from workers.config.host import HOST_FILE_PATH, fingerprint, reload_plan
from workers.config.worker import WorkerSettings, describe_error
from workers.exits import (
    EXIT_DEVICE,
    EXIT_ENVIRONMENT,
    EXIT_STOPPED,
    PERMANENT,
)
from workers.fleet import plan
from workers.fleet.children import Child
from workers.fleet.exposition import FleetMetrics, Scrape
from workers.fleet.failing import backoff_s
from workers.fleet.forkserver import ForkServer
from workers.fleet.host import (
    Host,
    bases,
    check_partitions,
    child_environment,
    make_child,
    preloaded,
    start_mps,
)
from workers.fleet.mps import MpsUnavailable
from workers.fleet.starting import (
    FIRST_START_TIMEOUT_S,
    card_of,
    count_failed_start,
    failed_at_start,
    model_error_of_one_process,
    start_all,
    start_model,
    tally,
)
from workers.fleet.state import Model, State, left_out, sync
from workers.observe.health import Check, HealthServer
from workers.types import ConfigError

log = logging.getLogger("conveyor.fleet")

STABLE_AFTER_S = 60.0  # a process up this long starts its backoff afresh
_POLL_S = 0.5


async def supervise(
    models: Sequence[tuple[WorkerSettings, list[plan.Slot]]],
    given: tuple[list[str], dict[str, str]],
    cards: list[plan.Card],
    host: Host | None = None,
) -> int:
    """Run each model's slots until SIGTERM or SIGINT; the exit status of the host.
    The first model's settings are the host's own (metrics port, MPS, drain bound).

    Raises ``ConfigError`` (topics missing, too few partitions for an explicit count)
    and ``ConnectFailed`` (Kafka unreachable) before any process starts, for a host of
    one model; a host file's model that cannot start is left out, said why.
    """
    state = State(host=host)
    _stop_on_signals(state)
    started = time.monotonic()
    # Its imports run while the topics are checked and MPS starts.
    processes = sum(len(slots) for _, slots in models)
    threads = plan.decode_threads(len(os.sched_getaffinity(0)), processes)
    modules = list(dict.fromkeys(m for settings, _ in models for m in preloaded(settings)))
    state.forks = await ForkServer.start(modules, child_environment(threads, {}))
    try:
        return await _supervise(models, given, cards, state, started)
    finally:
        await state.forks.close()


async def _supervise(
    models: Sequence[tuple[WorkerSettings, list[plan.Slot]]],
    given: tuple[list[str], dict[str, str]],
    cards: list[plan.Card],
    state: State,
    started: float,
) -> int:
    settings = models[0][0]  # the host's own
    for model_settings, slots in models:
        model = Model(model_settings, slots)
        state.models[model.name] = model
        try:
            model.slots = await check_partitions(model_settings, slots)
        except ConfigError as exc:
            if state.host is None:
                raise
            left_out(state, model, str(exc))
    try:
        state.mps = start_mps(settings, [s for m in state.models.values() for s in m.slots])
    except MpsUnavailable as exc:
        log.error("--mps on, but MPS cannot run here: %s", exc)
        return EXIT_ENVIRONMENT
    mps_env = dict(state.mps.env) if state.mps is not None else {}
    cores = len(os.sched_getaffinity(0))
    threads = plan.decode_threads(cores, sum(len(m.slots) for m in state.models.values()))
    flags, secrets = given
    env = {**secrets, **mps_env}
    for model in state.models.values():
        if not model.failed:
            model.children = _children(model, state, flags, cards, threads, env)
    sync(state)
    # A host file's host-wide gauges (ready, cards, restarts, loop lag) say model="host".
    label = "host" if state.host is not None else settings.served_name
    metrics = state.metrics = FleetMetrics(label, lambda: _sources(state))
    checks: dict[str, Check] = {
        "processes_ready": lambda: _all_ready(state, metrics),
        "cards": lambda: _cards_serving(state),
        "models": lambda: _models_serving(state),
        "not_draining": lambda: not state.stop.is_set(),
    }
    try:
        async with HealthServer(
            metrics,
            checks,
            host=settings.metrics_host,
            port=settings.metrics_port,
            scoped=lambda name: _model_checks(state, metrics, name),
            documents=_documents(state),
        ):
            state.failures = tally(state.children)  # a first process's failed starts count
            metrics.set_cards(len(state.failures.serving_cards()), 0)
            await start_all(state, cards, started)
            state.failures = tally(state.children, state.failures)  # some may not fit
            failed = len(state.failures.failed_cards())
            metrics.set_cards(len(state.failures.serving_cards()), failed)
            announce = asyncio.create_task(_announce_ready(state, metrics, started))
            roller = asyncio.create_task(
                _roll_on_request(state, metrics, _Making(flags, cards, threads, env))
            )
            try:
                await _watch(state, metrics)
            finally:
                announce.cancel()
                roller.cancel()
    finally:
        await _stop_all(state, settings)
        if state.mps is not None:
            state.mps.stop()
    log.info("every worker process stopped")
    return EXIT_STOPPED if state.failure is None else state.failure


@dataclass(frozen=True)
class _Making:
    """What making a model's processes takes beyond its settings (for a model added by
    SIGHUP): the user's flags, the cards, each process's threads, the environment."""

    flags: list[str]
    cards: list[plan.Card]
    threads: int
    env: dict[str, str]


def _children(
    model: Model,
    state: State,
    flags: list[str],
    cards: list[plan.Card],
    threads: int,
    env: dict[str, str],
) -> list[Child]:
    """``model``'s processes: named ``<host>-<card>-<n>`` for a host of one model,
    ``<host>-<model>-<card>-<n>`` for a host file's, which serve ``--host-model``."""
    names = bases(model.settings)
    if state.host is not None:
        names = names._replace(
            instance=f"{names.instance}-{model.name}", worker=f"{names.worker}-{model.name}"
        )
        flags = [*flags, "--host-model", model.name]
    return [
        make_child(model.settings, flags, slot, cards, names, threads, env) for slot in model.slots
    ]


# -- starting and watching -----------------------------------------------------------------


async def _watch(state: State, metrics: FleetMetrics) -> None:
    """Keep every process running until the host is told to stop (or a process ends it)."""
    if state.stop.is_set():
        return
    _keep_all([c for c in state.children if c not in state.retired], state, metrics)
    try:
        await state.stop.wait()
    finally:
        for keeper in state.keepers:
            keeper.cancel()
        await asyncio.gather(*state.keepers, return_exceptions=True)


def _keep_all(children: Sequence[Child], state: State, metrics: FleetMetrics) -> None:
    state.keepers = [k for k in state.keepers if not k.done()]
    state.keepers += [asyncio.create_task(_keep(child, state, metrics)) for child in children]


async def _keep(child: Child, state: State, metrics: FleetMetrics) -> None:
    failures = 0
    while not state.stop.is_set():
        watcher = asyncio.create_task(_until_ready(child, state))
        try:
            status = await child.wait()
        finally:
            watcher.cancel()
        if state.stop.is_set() or child in state.retired or child in state.removed:
            return
        up_s = time.monotonic() - child.started_at
        if child in state.rolling and status == EXIT_STOPPED:  # drained for a rolling restart
            await child.start()
            metrics.restarted()
            continue
        if child in state.rolling and status in PERMANENT:
            log.error(
                "process %s exited with status %d after its rolling restart: the new settings "
                "or model do not start; it stays stopped, the processes not yet restarted "
                "serve on, and the host is unready until it is fixed (then SIGHUP again)",
                child.name,
                status,
            )
            return
        if status in PERMANENT and not model_error_of_one_process(state, child, status):
            log.error(
                "process %s exited with status %d, which restarting cannot change: "
                "stopping the host",
                child.name,
                status,
            )
            state.failure = status
            state.stop.set()
            return
        if failed_at_start(child, status) and count_failed_start(child, status, state):
            return
        if status == EXIT_DEVICE:
            _restart_card(child, state)
        failures = 1 if up_s >= STABLE_AFTER_S else failures + 1
        delay = backoff_s(failures)
        log.warning(
            "process %s exited with status %s after %.0f s; starting it again in %.0f s",
            child.name,
            status,
            up_s,
            delay,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.stop.wait(), delay)
        if state.stop.is_set():
            return
        await child.start()
        metrics.restarted()


async def _until_ready(child: Child, state: State) -> None:
    """Poll ``child`` until it is ready (its failed starts then no longer count) or ends."""
    while child.running:
        if await child.ready():
            state.failures.served(child.name)
            state.retrying.pop(child.name, None)
            return
        await asyncio.sleep(_POLL_S)


def _cards_serving(state: State) -> bool | str:
    """/readyz's ``cards`` check: fails, saying why, once any process was retired, or
    while a process's failed starts are counted towards that."""
    if not state.retired and not state.retrying:
        return True
    failed = state.failures.failed_cards()
    said = [f"{card} failed at start: {error}" for card, error in failed.items()]
    alone = sorted(c.name for c in state.retired if card_of(c.slot) not in failed)
    if alone:
        said.append(f"not started again after failing at start: {', '.join(alone)}")
    said += state.retrying.values()
    return "; ".join(said)


async def _roll_on_request(state: State, metrics: FleetMetrics, making: _Making) -> None:
    """On each SIGHUP, restart the processes in turns of one a card (one at a time on a
    host of one card; a card never has more than one of its processes away): each drains
    (its partitions go to the others only if it is away longer than the session timeout:
    static membership), starts again reading its settings and model afresh (a new config
    file, new weights at the same path), and is ready before its card's next one stops. A
    process that will not start again stops the round; the others keep what they run.

    A host file is read again first: models added start, models removed drain and stop,
    models changed (their table, or the shared settings) restart in turns as above, and
    the others are not touched."""
    while True:
        await state.roll.wait()
        state.roll.clear()
        if state.host is None:
            await _roll(state.children, state)
        else:
            await _reload(state, metrics, making)
        await _all_ready(state, metrics)


async def _roll(children: Sequence[Child], state: State) -> None:
    serving = [c for c in children if c not in state.retired]
    turns = rolling_turns(serving)
    log.info(
        "SIGHUP: restarting %d worker processes in %d turns, one a card at a time",
        len(serving),
        len(turns),
    )
    for turn in turns:
        done = await asyncio.gather(*(_restart_in_turn(child, state) for child in turn))
        if not all(done):
            failed = ", ".join(c.name for c, ok in zip(turn, done, strict=True) if not ok)
            log.error("rolling restart stopped at %s", failed)
            return
    log.info("rolling restart done: every worker process started again")


def _documents(state: State) -> dict[str, Callable[[], object]]:
    """``/host-file``: what ``--check`` needs to say what a reload would do (a host file's
    ``fingerprint``: digests, counts and cards, no setting's value)."""
    host = state.host
    if host is None:
        return {}
    return {HOST_FILE_PATH: lambda: fingerprint(host.file, list(state.models))}


async def _reload(state: State, metrics: FleetMetrics, making: _Making) -> None:
    """SIGHUP on a host file: what changed in it, done (``workers.config.host``)."""
    assert state.host is not None
    try:
        after = state.host.read()
        fresh = {m.name: _fresh_settings(state.host, m.name) for m in after.models}
    except (SettingsError, ValueError) as exc:
        log.error("SIGHUP: the host file is not reloaded, nothing changes: %s", exc)
        return
    before = state.host.file
    reload = reload_plan(before, after, running=list(state.models))
    for name in [*reload.changed, *reload.unchanged]:
        model = state.models[name]
        if model.failed:  # left out before: tried again, as a model added, changed or not
            for listed in (reload.changed, reload.unchanged):
                if name in listed:
                    listed.remove(name)
            reload.added.append(name)
            state.models.pop(name)
            state.retired.difference_update(model.children)
    log.info("SIGHUP: host file %s: %s", state.host.path, reload.describe())
    state.host.file = after
    gone = [state.models.pop(name) for name in reload.removed]
    leaving = [c for model in gone for c in model.children if c not in state.retired]
    state.removed.update(leaving)
    sync(state)
    for child in leaving:
        child.signal(signal.SIGTERM)
    for name in reload.changed:
        model = state.models[name]
        slots = await _replanned(model, fresh[name], state)
        if slots is None:
            model.settings = fresh[name]
            await _roll(model.children, state)
        elif slots:
            await _replace(model, fresh[name], slots, state, metrics, making)
    for name in reload.added:
        await _add(fresh[name], state, metrics, making)
    if leaving:
        await asyncio.gather(*(c.wait() for c in leaving))
        log.info("models %s drained and stopped", ", ".join(m.name for m in gone))
    state.failures = tally([c for c in state.children if c not in state.retired])
    log.info("rolling restart done: host file reloaded")


def _fresh_settings(host: Host, name: str) -> WorkerSettings:
    """Model ``name``'s settings as the host file says now; raises ValueError saying what
    is wrong as ``--check`` does (``describe_error``)."""
    try:
        return host.settings_for(name)
    except ValidationError as exc:
        raise ValueError(describe_error(exc, name)) from None


async def _replanned(
    model: Model, settings: WorkerSettings, state: State
) -> list[plan.Slot] | None:
    """A changed model's processes under its new settings, checked against its topics,
    when they are not the ones it runs (its count or cards changed); None when they
    are; [] when they cannot be had (the error logged: the model keeps its processes)."""
    assert state.host is not None
    try:
        slots = state.host.slots_for(settings)
        if slots == model.slots:
            return None
        checked = await check_partitions(settings, slots)
    except (ConfigError, ValueError) as exc:
        log.error("SIGHUP: model %s keeps its %d processes: %s", model.name, len(model.slots), exc)
        return []
    return checked


async def _replace(
    model: Model,
    settings: WorkerSettings,
    slots: list[plan.Slot],
    state: State,
    metrics: FleetMetrics,
    making: _Making,
) -> None:
    """A model whose processes change in count or cards: drained and stopped, then
    started anew as the host file now says (its static members' names change)."""
    log.info(
        "model %s: %d processes become %d: draining them, then starting the new ones",
        model.name, len(model.slots), len(slots),
    )  # fmt: skip
    state.models.pop(model.name)
    leaving = [c for c in model.children if c not in state.retired]
    state.removed.update(leaving)
    sync(state)
    for child in leaving:
        child.signal(signal.SIGTERM)
    await asyncio.gather(*(c.wait() for c in leaving))
    await _add(settings, state, metrics, making, slots)


async def _add(
    settings: WorkerSettings,
    state: State,
    metrics: FleetMetrics,
    making: _Making,
    slots: list[plan.Slot] | None = None,
) -> None:
    """A model the host file gained: planned, checked and started as at the host's
    start (``slots``: already planned and checked)."""
    assert state.host is not None
    model = Model(settings, [])
    state.models[model.name] = model
    try:
        model.slots = slots or await check_partitions(settings, state.host.slots_for(settings))
    except (ConfigError, ValueError) as exc:
        left_out(state, model, str(exc))
        return
    model.children = _children(model, state, making.flags, making.cards, making.threads, making.env)
    sync(state)
    state.failures = tally([c for c in state.children if c not in state.retired], state.failures)
    for child in model.children:
        child.forks = state.forks  # a child starts as a new process when it does not serve
    await start_model(model, state, making.cards, time.monotonic())
    _keep_all([c for c in model.children if c not in state.retired], state, metrics)


def rolling_turns(children: Sequence[Child]) -> list[list[Child]]:
    """The turns of a rolling restart: the n-th turn holds each card's n-th process."""
    cards: dict[int | None, list[Child]] = {}
    for child in children:
        cards.setdefault(child.slot.card, []).append(child)
    depth = max((len(on_card) for on_card in cards.values()), default=0)
    return [[on_card[n] for on_card in cards.values() if n < len(on_card)] for n in range(depth)]


async def _restart_in_turn(child: Child, state: State) -> bool:
    """Stop ``child`` and wait until its successor is ready; False if it does not get there."""
    starts = child.starts
    state.rolling.add(child)  # left there if it fails: its keeper leaves it stopped
    child.signal(signal.SIGTERM)
    deadline = time.monotonic() + FIRST_START_TIMEOUT_S
    while time.monotonic() < deadline and not state.stop.is_set():
        if child.starts > starts and await child.ready():
            state.rolling.discard(child)
            return True
        if child.starts > starts and not child.running and child.returncode in PERMANENT:
            return False
        await asyncio.sleep(_POLL_S)  # its readiness is polled: it lives in the process
    return False


async def _announce_ready(state: State, metrics: FleetMetrics, started: float) -> None:
    """Log once when every process is first ready: the host's time to ready."""
    while True:
        if await _all_ready(state, metrics):
            break
        await asyncio.sleep(_POLL_S)  # readiness is polled: it lives in the processes
    serving = [child for child in state.children if child not in state.retired]
    devices = sorted({child.slot.device for child in serving})
    left_out = [model.name for model in state.models.values() if model.failed]
    log.info(
        "host ready: %d worker processes on %s, %.1f s after start%s",
        len(serving),
        ", ".join(devices),
        time.monotonic() - started,
        f" (left out, unready: {', '.join(left_out)})" if left_out else "",
    )


def _restart_card(failed: Child, state: State) -> None:
    """A device fault: the card's other processes stop too (their keepers start them again)."""
    for child in state.children:
        if child is not failed and child.slot.card == failed.slot.card and child.running:
            child.signal(signal.SIGTERM)


async def _stop_all(state: State, settings: WorkerSettings) -> None:
    """SIGTERM to every process, then wait for their drains (SIGKILL past the bound)."""
    running = [child for child in state.children if child.running]
    for child in running:
        child.signal(signal.SIGTERM)
    bound = settings.rebalance_timeout_ms / 1000.0 + 10.0
    try:
        await asyncio.wait_for(asyncio.gather(*(c.wait() for c in running)), bound)
    except TimeoutError:
        log.error("processes still draining after %.0f s: killing them", bound)
        for child in running:
            child.signal(signal.SIGKILL)
        await asyncio.gather(*(c.wait() for c in running))


def _sources(state: State) -> list[tuple[str, Scrape]]:
    return [(child.name, child.metrics) for child in state.children]


async def _all_ready(state: State, metrics: FleetMetrics) -> bool:
    """Whether every process not retired is ready (``cards`` and ``models`` say what
    was retired)."""
    every = await asyncio.gather(
        *(_model_ready(model, state, metrics) for model in list(state.models.values()))
    )
    return bool(every) and all(every)


async def _model_ready(model: Model, state: State, metrics: FleetMetrics) -> bool:
    """Whether ``model``'s processes not retired are all ready; its metrics set."""
    children = model.children
    serving = [c for c in children if c not in state.retired]
    ready = await asyncio.gather(*(child.ready() for child in serving))
    running = sum(child.running for child in children)
    failed = len(children) - len(serving)
    metrics.set_processes(len(children), running, sum(ready), failed, model=model.name)
    return all(ready)


def _models_serving(state: State) -> bool | str:
    """/readyz's ``models`` check: fails, naming each model that cannot serve and why."""
    failed = [f"model {m.name}: {m.failed}" for m in state.models.values() if m.failed]
    return "; ".join(failed) or True


def _model_checks(state: State, metrics: FleetMetrics, name: str) -> dict[str, Check] | None:
    """/readyz?model=NAME: that model's readiness alone (None: no such model here)."""
    model = state.models.get(name)
    if model is None:
        return None
    return {
        "processes_ready": lambda: _model_ready(model, state, metrics),
        "model": lambda: f"cannot serve: {model.failed}" if model.failed else True,
        "not_draining": lambda: not state.stop.is_set(),
    }


def _stop_on_signals(state: State) -> None:
    """First SIGTERM/SIGINT: every process drains. Second: they are killed, and so is this."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if state.stop.is_set():
            log.warning("second %s: killing the worker processes", name)
            for child in state.children:
                child.signal(signal.SIGKILL)
            if state.mps is not None:
                state.mps.stop()
            os._exit(128 + signum)
        log.info("%s: draining every worker process, then stopping", name)
        state.stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, state.roll.set)
