"""The supervisor: one ``conveyor worker`` runs a host's worker processes at full speed.

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
4. **start**: the processes are forked by the host's fork server, which imported
   torch, torchvision and Inductor once (``workers.fleet.forkserver``); one process
   first, which compiles the model into the host's compile
   cache (``workers.model.compile_cache``); once it has loaded and warmed up, its
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
   no card is left, the host exits ``EXIT_NO_CARD``;
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
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.config.worker import COMPILE_CACHE_WARM_MARK, WorkerSettings
from workers.exits import (
    EXIT_DEVICE,
    EXIT_ENVIRONMENT,
    EXIT_NO_CARD,
    EXIT_STOPPED,
    EXIT_UNREACHABLE,
    PERMANENT,
)
from workers.fleet import gpus, plan
from workers.fleet.children import Child, http_get
from workers.fleet.exposition import FleetMetrics, Scrape
from workers.fleet.failing import StartFailures, error_line
from workers.fleet.forkserver import ForkServer
from workers.fleet.host import (
    bases,
    check_partitions,
    child_environment,
    make_child,
    preloaded,
    start_mps,
)
from workers.fleet.mps import MpsServer, MpsUnavailable
from workers.observe.health import Check, HealthServer

log = logging.getLogger("conveyor.fleet")

FIRST_START_TIMEOUT_S = 900.0  # a cold compile of a large model on a slow host
FORK_SERVER_TIMEOUT_S = 300.0  # its imports: ~10 s on a GPU host
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a process up this long starts its backoff afresh
_POLL_S = 0.5


@dataclass
class _State:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    failure: int | None = None  # the status the host stops with, when a process ended it
    mps: MpsServer | None = None
    forks: ForkServer | None = None
    children: list[Child] = field(default_factory=list)
    roll: asyncio.Event = field(default_factory=asyncio.Event)  # SIGHUP: restart in turn
    rolling: set[Child] = field(default_factory=set)  # stopped on purpose, to start at once
    failures: StartFailures = field(default_factory=lambda: StartFailures({}))
    retired: set[Child] = field(default_factory=set)  # failed at start: not started again


async def supervise(
    settings: WorkerSettings,
    given: tuple[list[str], dict[str, str]],
    slots: list[plan.Slot],
    cards: list[plan.Card],
) -> int:
    """Run ``slots`` until SIGTERM or SIGINT; the exit status of the host.

    Raises ``ConfigError`` (topics missing, too few partitions for an explicit count)
    and ``ConnectFailed`` (Kafka unreachable) before any process starts.
    """
    state = _State()
    _stop_on_signals(state)
    started = time.monotonic()
    # Its imports run while the topics are checked and MPS starts.
    threads = plan.decode_threads(len(os.sched_getaffinity(0)), len(slots))
    state.forks = await ForkServer.start(preloaded(settings), child_environment(threads, {}))
    try:
        return await _supervise(settings, given, slots, cards, state, started)
    finally:
        await state.forks.close()


async def _supervise(
    settings: WorkerSettings,
    given: tuple[list[str], dict[str, str]],
    slots: list[plan.Slot],
    cards: list[plan.Card],
    state: _State,
    started: float,
) -> int:
    slots = await check_partitions(settings, slots)
    try:
        state.mps = start_mps(settings, slots)
    except MpsUnavailable as exc:
        log.error("--mps on, but MPS cannot run here: %s", exc)
        return EXIT_ENVIRONMENT
    mps_env = dict(state.mps.env) if state.mps is not None else {}
    names = bases(settings)
    cores = len(os.sched_getaffinity(0))
    threads = plan.decode_threads(cores, len(slots))
    flags, secrets = given
    env = {**secrets, **mps_env}
    state.children = [
        make_child(settings, flags, slot, cards, names, threads, env) for slot in slots
    ]
    metrics = FleetMetrics(settings.served_name, lambda: _sources(state))
    checks: dict[str, Check] = {
        "processes_ready": lambda: _all_ready(state, metrics),
        "cards": lambda: _cards_serving(state),
        "not_draining": lambda: not state.stop.is_set(),
    }
    try:
        async with HealthServer(
            metrics, checks, host=settings.metrics_host, port=settings.metrics_port
        ):
            await _start_all(settings, state, cards, started)
            state.failures = _tally(state.children)
            metrics.set_cards(len(state.failures.serving_cards()), 0)
            announce = asyncio.create_task(_announce_ready(state, metrics, started))
            roller = asyncio.create_task(_roll_on_request(state, metrics))
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


# -- starting and watching -----------------------------------------------------------------


async def _use_fork_server(state: _State) -> None:
    """The processes start from the fork server once its imports are done, as new
    processes when it cannot serve (the reason logged)."""
    assert state.forks is not None
    try:
        serving = await asyncio.wait_for(state.forks.ready(), FORK_SERVER_TIMEOUT_S)
    except TimeoutError:
        state.forks.reason = f"its imports took over {FORK_SERVER_TIMEOUT_S:.0f} s"
        serving = False
    if serving:
        for child in state.children:
            child.forks = state.forks
    else:
        log.warning(
            "worker processes start as new processes, each importing torch itself: %s",
            state.forks.reason,
        )


async def _start_all(
    settings: WorkerSettings,
    state: _State,
    cards: list[plan.Card],
    started: float,
) -> None:
    """The first process, until its model is loaded (compiled into the cache, its
    weights downloaded); then the others at once. The host's /healthz answers while the
    fork server imports."""
    first, *rest = state.children
    await _use_fork_server(state)
    if state.stop.is_set():
        return
    await first.start()
    loaded = await _until_loaded(first, state)
    if not loaded and state.mps is not None and not state.stop.is_set():
        status = await first.wait()
        if status in PERMANENT or status == EXIT_UNREACHABLE:  # not MPS's doing
            log.error("the first worker process exited with status %s before it was ready", status)
            state.failure = status
            state.stop.set()
            return
        await _without_mps(state, first, status)
        loaded = await _until_loaded(first, state)
    if state.stop.is_set():
        return
    if not loaded:
        status = await first.wait()
        log.error("the first worker process exited with status %s before it was ready", status)
        state.failure = status if status > 0 else 1
        state.stop.set()
        return
    log.info(
        "first process %s ready to share its compiled model after %.1f s; starting %d more",
        first.name,
        time.monotonic() - started,
        len(rest),
    )
    rest = _fit_in_memory(settings, state, cards, first, rest)
    await asyncio.gather(*(child.start() for child in rest))


async def _until_loaded(child: Child, state: _State) -> bool:
    """Whether ``child`` loaded and warmed up its model (its /readyz says so), or found its
    compile cache warm (nothing left to compile first), before it exited or the host was
    told to stop."""
    deadline = time.monotonic() + FIRST_START_TIMEOUT_S
    while time.monotonic() < deadline and not state.stop.is_set():
        if not child.running:
            return False
        if (
            child.compile_cache is not None
            and (child.compile_cache / COMPILE_CACHE_WARM_MARK).exists()
        ):
            return True
        if child.port is not None and await _model_loaded(child.port):
            return True
        await asyncio.sleep(_POLL_S)
    return False


async def _model_loaded(port: int) -> bool:
    try:
        _, body = await http_get(port, "/readyz")
        checks = json.loads(body).get("checks", {})
    except (OSError, TimeoutError, ValueError):
        return False
    return bool(checks.get("model_loaded") == "ok")


async def _without_mps(state: _State, first: Child, status: int) -> None:
    """The first process failed under the supervisor's MPS server: run without it."""
    assert state.mps is not None
    log.warning(
        "the first worker process failed under MPS (status %s; MPS logs: %s): running without MPS",
        status,
        state.mps.log_tail() or "empty",
    )
    state.mps.stop()
    for child in state.children:
        for name in state.mps.env:
            child.env.pop(name, None)
    state.mps = None
    await first.start()


def _fit_in_memory(
    settings: WorkerSettings,
    state: _State,
    cards: list[plan.Card],
    first: Child,
    rest: list[Child],
) -> list[Child]:
    """``rest``, without the processes its cards' memory cannot hold (``auto`` only)."""
    card = next((c for c in cards if c.index == first.slot.card), None)
    if settings.processes != "auto" or card is None:
        return rest
    used = gpus.memory_used_mb(card)
    if used is None:
        return rest
    one = used - card.used_mb
    keep = []
    for candidate in cards:
        wanted = [c for c in state.children if c.slot.card == candidate.index]
        fit = plan.fit_in_memory(candidate, one, len(wanted))
        if fit < len(wanted):
            log.warning(
                "GPU %d (%s) holds %d processes of %d MiB each, not %d: running %d",
                candidate.index, candidate.name, fit, one, len(wanted), fit,
            )  # fmt: skip
        keep += wanted[:fit]
    state.children = [c for c in state.children if c in keep]
    return [c for c in rest if c in keep]


async def _watch(state: _State, metrics: FleetMetrics) -> None:
    """Keep every process running until the host is told to stop (or a process ends it)."""
    if state.stop.is_set():
        return
    keepers = [asyncio.create_task(_keep(child, state, metrics)) for child in state.children]
    try:
        await state.stop.wait()
    finally:
        for keeper in keepers:
            keeper.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)


async def _keep(child: Child, state: _State, metrics: FleetMetrics) -> None:
    failures = 0
    while not state.stop.is_set():
        watcher = asyncio.create_task(_until_ready(child, state))
        try:
            status = await child.wait()
        finally:
            watcher.cancel()
        if state.stop.is_set() or child in state.retired:
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
        if status in PERMANENT:
            log.error(
                "process %s exited with status %d, which restarting cannot change: "
                "stopping the host",
                child.name,
                status,
            )
            state.failure = status
            state.stop.set()
            return
        if _failed_at_start(child, status) and _retire(child, status, state, metrics):
            return
        if status == EXIT_DEVICE:
            _restart_card(child, state)
        failures = 1 if up_s >= STABLE_AFTER_S else failures + 1
        delay = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (failures - 1))
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


async def _until_ready(child: Child, state: _State) -> None:
    """Poll ``child`` until it is ready (its failed starts then no longer count) or ends."""
    while child.running:
        if await child.ready():
            state.failures.served(child.name)
            return
        await asyncio.sleep(_POLL_S)


def _failed_at_start(child: Child, status: int) -> bool:
    """An error exit before it was ever ready: one that a Kafka outage explains (status 4)
    does not count, nor a signal's (a kill, an out-of-memory kill)."""
    return status > 0 and status != EXIT_UNREACHABLE and not child.ready_seen


def _retire(child: Child, status: int, state: _State, metrics: FleetMetrics) -> bool:
    """Count ``child``'s failed start; retire what the count condemns (``failing``), say
    why once, and stop the host when no card is left. Whether ``child`` was retired."""
    error = error_line(child.last_lines)
    newly = state.failures.failed(child.name, error)
    if not newly:
        return False
    retired = [c for c in state.children if c.name in newly]
    state.retired.update(retired)
    for other in retired:
        other.signal(signal.SIGTERM)  # a process of that card still starting
    card = _card(child.slot)
    many = len(retired) > 1
    what = (
        f"{card}: its {len(retired)} worker processes failed at start the same way"
        if many
        else f"process {child.name} failed at start the same way again and again"
    )
    log.error(
        "%s (status %d): %s. %s not started again: %s partitions go to the group's other "
        "processes once its session timeout (--session-timeout-ms) has passed. The whole "
        "error is in %s output above: fix its cause (a model or compile form that does not "
        "run on this card, too little memory on it), then restart the host",
        what,
        status,
        error,
        "They are" if many else "It is",
        "their" if many else "its",
        "their" if many else "its",
    )
    failed = len(state.failures.failed_cards())
    metrics.set_cards(len(state.failures.serving_cards()), failed)
    if state.failures.none_serve:
        log.error(
            "no card of this host can serve: stopping the host (exit status %d)", EXIT_NO_CARD
        )
        state.failure = EXIT_NO_CARD
        state.stop.set()
    return child in retired


def _card(slot: plan.Slot) -> str:
    return "the CPU" if slot.card is None else f"GPU {slot.card}"


def _tally(children: list[Child]) -> StartFailures:
    cards: dict[str, list[str]] = {}
    for child in children:
        cards.setdefault(_card(child.slot), []).append(child.name)
    return StartFailures(cards)


def _cards_serving(state: _State) -> bool | str:
    """/readyz's ``cards`` check: fails, saying why, once any process was retired."""
    if not state.retired:
        return True
    failed = state.failures.failed_cards()
    said = [f"{card} failed at start: {error}" for card, error in failed.items()]
    alone = sorted(c.name for c in state.retired if _card(c.slot) not in failed)
    if alone:
        said.append(f"not started again after failing at start: {', '.join(alone)}")
    return "; ".join(said)


async def _roll_on_request(state: _State, metrics: FleetMetrics) -> None:
    """On each SIGHUP, restart the processes in turns of one a card (one at a time on a
    host of one card; a card never has more than one of its processes away): each drains
    (its partitions go to the others only if it is away longer than the session timeout:
    static membership), starts again reading its settings and model afresh (a new config
    file, new weights at the same path), and is ready before its card's next one stops. A
    process that will not start again stops the round; the others keep what they run."""
    while True:
        await state.roll.wait()
        state.roll.clear()
        serving = [c for c in state.children if c not in state.retired]
        turns = rolling_turns(serving)
        log.info(
            "SIGHUP: restarting the %d worker processes in %d turns, one a card at a time",
            len(serving),
            len(turns),
        )
        for turn in turns:
            done = await asyncio.gather(*(_restart_in_turn(child, state) for child in turn))
            if not all(done):
                failed = ", ".join(c.name for c, ok in zip(turn, done, strict=True) if not ok)
                log.error("rolling restart stopped at %s", failed)
                break
        else:
            log.info("rolling restart done: every worker process started again")
        await _all_ready(state, metrics)


def rolling_turns(children: Sequence[Child]) -> list[list[Child]]:
    """The turns of a rolling restart: the n-th turn holds each card's n-th process."""
    cards: dict[int | None, list[Child]] = {}
    for child in children:
        cards.setdefault(child.slot.card, []).append(child)
    depth = max((len(on_card) for on_card in cards.values()), default=0)
    return [[on_card[n] for on_card in cards.values() if n < len(on_card)] for n in range(depth)]


async def _restart_in_turn(child: Child, state: _State) -> bool:
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


async def _announce_ready(state: _State, metrics: FleetMetrics, started: float) -> None:
    """Log once when every process is first ready: the host's time to ready."""
    while True:
        if await _all_ready(state, metrics):
            break
        await asyncio.sleep(_POLL_S)  # readiness is polled: it lives in the processes
    devices = sorted({child.slot.device for child in state.children})
    log.info(
        "host ready: %d worker processes on %s, %.1f s after start",
        len(state.children),
        ", ".join(devices),
        time.monotonic() - started,
    )


def _restart_card(failed: Child, state: _State) -> None:
    """A device fault: the card's other processes stop too (their keepers start them again)."""
    for child in state.children:
        if child is not failed and child.slot.card == failed.slot.card and child.running:
            child.signal(signal.SIGTERM)


async def _stop_all(state: _State, settings: WorkerSettings) -> None:
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


def _sources(state: _State) -> list[tuple[str, Scrape]]:
    return [(child.name, child.metrics) for child in state.children]


async def _all_ready(state: _State, metrics: FleetMetrics) -> bool:
    """Whether every process not retired is ready (``cards`` says what was retired)."""
    serving = [child for child in state.children if child not in state.retired]
    ready = await asyncio.gather(*(child.ready() for child in serving))
    running = sum(child.running for child in state.children)
    metrics.set_processes(len(state.children), running, sum(ready), len(state.retired))
    return bool(ready) and all(ready)


def _stop_on_signals(state: _State) -> None:
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
