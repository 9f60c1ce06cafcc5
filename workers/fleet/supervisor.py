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
4. **start**: one process first, which compiles the model into the host's compile
   cache (``workers.model.compile_cache``); once it has loaded and warmed up, its
   memory on the card is measured (``auto`` fits the count to it) and the others
   start together, loading what it compiled;
5. **watch**: ``/metrics`` on ``--metrics-port`` merges every process's
   (``workers.fleet.exposition``), ``/readyz`` is 200 when every process is ready,
   ``/healthz`` while the supervisor runs. A process that exits is started again
   with backoff (1 s doubling to 30 s, back to 1 s after a minute up), except after
   a status that restarting cannot change (settings, configuration, install,
   environment: ``workers.exits.PERMANENT``), which stops the host with that status;
   a device fault (status 7: under MPS one client's fault ends its card's clients)
   restarts every process of that card;
6. **stop**: SIGTERM or SIGINT is passed to every process, which drains and commits;
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
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from common.security import kafka_connect_failed, kafka_options
from schemas import consumer_group, topics_for
from workers.config.worker import COMPILE_CACHE_WARM_MARK, WorkerSettings
from workers.exits import EXIT_DEVICE, EXIT_ENVIRONMENT, EXIT_STOPPED, PERMANENT
from workers.fleet import gpus, plan
from workers.fleet.children import Child, http_get
from workers.fleet.exposition import FleetMetrics, Scrape
from workers.fleet.mps import MpsServer, MpsUnavailable, running_server
from workers.kafka.topics import check_topics
from workers.observe.health import Check, HealthServer
from workers.types import ConfigError

log = logging.getLogger("conveyor.fleet")

CHILD_COMMAND = (sys.executable, "-m", "workers.cli")
FIRST_START_TIMEOUT_S = 900.0  # a cold compile of a large model on a slow host
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a process up this long starts its backoff afresh
_POLL_S = 0.5
_OVERRIDDEN = frozenset(
    {
        "processes",
        "device",
        "gpus",
        "mps",
        "group_instance_id",
        "worker_id",
        "metrics_host",
        "metrics_port",
    }
)


class FleetError(ConfigError):
    """The host cannot run the processes asked for; the message says what to change."""


@dataclass
class _State:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    failure: int | None = None  # the status the host stops with, when a process ended it
    mps: MpsServer | None = None
    children: list[Child] = field(default_factory=list)


def planned(settings: WorkerSettings) -> tuple[list[plan.Slot], list[plan.Card]]:
    """The processes this host would run (before the partition and memory checks).
    Raises ValueError for cards that are not there."""
    cards = [] if settings.device == "cpu" else gpus.visible_cards()
    if settings.device.startswith("cuda") and not cards:
        raise ValueError(
            f"device {settings.device}: no GPU is visible here (nvidia-smi lists none, or "
            "CUDA_VISIBLE_DEVICES hides them); use --device cpu, or run on a GPU host"
        )
    chosen = plan.chosen_cards(settings.gpus, settings.device, cards)
    cores = len(os.sched_getaffinity(0))
    return plan.slots(plan.parse_processes(settings.processes), chosen, cores), chosen


def child_flags(given: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """The user's own flags (``given``: field -> value as parsed) for every process, and
    the secret ones as ``CONVEYOR_*`` variables (a command line is visible to ``ps``)."""
    flags: list[str] = []
    env: dict[str, str] = {}
    for name, value in given.items():
        if name in _OVERRIDDEN or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if _secret(name):
            env[f"CONVEYOR_{name.upper()}"] = str(value)
        elif isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags, env


def _secret(name: str) -> bool:
    annotation = WorkerSettings.model_fields[name].annotation
    return annotation is not None and "SecretStr" in str(annotation)


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
    slots = await _check_partitions(settings, slots)
    mps_env = _start_mps(settings, slots, state)
    if mps_env is None:
        return EXIT_ENVIRONMENT
    names = _bases(settings)
    cores = len(os.sched_getaffinity(0))
    threads = plan.decode_threads(cores, len(slots))
    flags, secrets = given
    env = {**secrets, **mps_env}
    state.children = [_child(settings, flags, slot, names, threads, env) for slot in slots]
    metrics = FleetMetrics(settings.served_name, lambda: _sources(state))
    checks: dict[str, Check] = {
        "processes_ready": lambda: _all_ready(state, metrics),
        "not_draining": lambda: not state.stop.is_set(),
    }
    try:
        async with HealthServer(
            metrics, checks, host=settings.metrics_host, port=settings.metrics_port
        ):
            await _start_all(settings, state, cards, started)
            announce = asyncio.create_task(_announce_ready(state, metrics, started))
            try:
                await _watch(state, metrics)
            finally:
                announce.cancel()
    finally:
        await _stop_all(state, settings)
        if state.mps is not None:
            state.mps.stop()
    log.info("every worker process stopped")
    return EXIT_STOPPED if state.failure is None else state.failure


# -- before the processes ------------------------------------------------------------------


async def _check_partitions(settings: WorkerSettings, slots: list[plan.Slot]) -> list[plan.Slot]:
    """``slots``, fewer for ``auto`` when the request topics have too few partitions.

    Raises ``FleetError`` for an explicit count they cannot serve, ``TopicProblem``
    (also a ``ConfigError``) for topics missing or forbidden.
    """
    topics = topics_for(settings.served_name, settings.topic_prefix)
    try:
        facts = await check_topics(settings, topics)
    except (KafkaError, OSError) as exc:
        raise await kafka_connect_failed(settings.kafka_bootstrap, settings, exc) from None
    requests = [topics.lane(lane.name) for lane in settings.request_lanes]
    partitions = sum(facts.partitions[name] for name in requests)
    others = await _other_members(settings)
    room = partitions - others
    if len(slots) <= room:
        return slots
    seen = f" and {others} other members of the group" if others else ""
    advice = (
        f"the request topic{'s' if len(requests) > 1 else ''} {', '.join(requests)} "
        f"{'have' if len(requests) > 1 else 'has'} {partitions} partitions for {len(slots)} "
        f"processes of this host{seen}: a process without a partition is never ready. Add "
        f"partitions (kafka-topics.sh --alter --topic {requests[0]} --partitions "
        f"{len(slots) + others}), or run fewer processes (--processes N)"
    )
    if settings.processes != "auto" or room < 1:
        raise FleetError(advice)
    log.warning("%s; running %d processes", advice, room)
    return slots[:room]


async def _other_members(settings: WorkerSettings) -> int:
    """Members of the model's group that are not this host's processes (best effort: 0
    when the group cannot be described)."""
    group = consumer_group(settings.served_name, settings.topic_prefix)
    ours = _bases(settings).worker
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=f"{ours}-fleet-admin",
        **kafka_options(settings),
    )
    try:
        await admin.start()
        responses = await admin.describe_consumer_groups([group])
    except (KafkaError, OSError) as exc:  # the count is advice, not a condition to start
        log.info(
            "could not describe group %s (%s): counting this host's processes only", group, exc
        )
        return 0
    finally:
        await admin.close()
    members = [
        member
        for response in responses
        for found in response.to_object()["groups"]
        if found["group"] == group
        for member in found["members"]
    ]
    return sum(1 for m in members if not str(m["client_id"]).startswith(f"{ours}-"))


def _start_mps(
    settings: WorkerSettings, slots: list[plan.Slot], state: _State
) -> dict[str, str] | None:
    """The environment the processes need for MPS ({} without it); None when ``--mps on``
    cannot have it (the reason logged)."""
    on_card = [slot.card for slot in slots if slot.card is not None]
    crowded = any(on_card.count(card) > 1 for card in set(on_card))
    if settings.mps == "off" or not on_card or (settings.mps == "auto" and not crowded):
        return {}
    existing = running_server()
    if existing is not None:
        log.info("using the MPS server already running (pipes in %s)", existing)
        return {}
    try:
        state.mps = MpsServer.start()
    except MpsUnavailable as exc:
        if settings.mps == "on":
            log.error("--mps on, but MPS cannot run here: %s", exc)
            return None
        log.warning(
            "MPS cannot run here (%s): each card's processes take turns on it instead of "
            "overlapping (set --mps off to silence this)",
            exc,
        )
        return {}
    return dict(state.mps.env)


class _Bases(NamedTuple):
    """What the processes' names start with: the settings' own, or the host's name."""

    instance: str
    worker: str


def _bases(settings: WorkerSettings) -> _Bases:
    host = socket.gethostname()
    worker = settings.worker_id if "worker_id" in settings.model_fields_set else host
    return _Bases(settings.group_instance_id or host, worker)


def _child(
    settings: WorkerSettings,
    flags: Sequence[str],
    slot: plan.Slot,
    names: _Bases,
    threads: int,
    extra_env: dict[str, str],
) -> Child:
    overrides = [
        "--processes", "1",
        "--device", slot.device,
        "--mps", "off",
        "--group-instance-id", slot.name(names.instance),
        "--worker-id", slot.name(names.worker),
        "--metrics-host", "127.0.0.1",
        "--metrics-port", "0",
    ]  # fmt: skip
    if "decode_threads" not in settings.model_fields_set:
        overrides += ["--decode-threads", str(threads)]
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    # Each process's share of the cores for torch's own threads (unless set): otherwise
    # every process starts one a core, and the host's processes load their models at once.
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return Child(
        slot,
        slot.name(names.worker),
        [*CHILD_COMMAND, *flags, *overrides],
        env,
        json=settings.log_format == "json",
    )


# -- starting and watching -----------------------------------------------------------------


async def _start_all(
    settings: WorkerSettings,
    state: _State,
    cards: list[plan.Card],
    started: float,
) -> None:
    """The first process, until its model is loaded (compiled into the cache); then the
    others at once."""
    first, *rest = state.children
    await first.start()
    loaded = await _until_loaded(first, state)
    if not loaded and state.mps is not None and not state.stop.is_set():
        await _without_mps(state, first)
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


async def _without_mps(state: _State, first: Child) -> None:
    """The first process failed under the supervisor's MPS server: run without it."""
    assert state.mps is not None
    status = await first.wait()
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
        status = await child.wait()
        if state.stop.is_set():
            return
        up_s = time.monotonic() - child.started_at
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
    ready = await asyncio.gather(*(child.ready() for child in state.children))
    running = sum(child.running for child in state.children)
    metrics.set_processes(len(state.children), running, sum(ready))
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
