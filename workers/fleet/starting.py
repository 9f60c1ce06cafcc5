"""Starting a host's models: each one's first process, until its model is loaded, then
the others, as many as its cards' memory holds (``workers.fleet.supervisor``, step 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from pathlib import Path

from workers.config.worker import COMPILE_CACHE_WARM_MARK
from workers.exits import EXIT_BAD_SETTINGS, EXIT_NO_CARD, EXIT_UNREACHABLE, PERMANENT
from workers.fleet import gpus, plan
from workers.fleet.children import Child, http_get
from workers.fleet.failing import REPEATS, StartFailures, backoff_s, error_line
from workers.fleet.state import Model, State, left_out, sync

log = logging.getLogger("conveyor.fleet")

FIRST_START_TIMEOUT_S = 900.0  # a cold compile of a large model on a slow host
FORK_SERVER_TIMEOUT_S = 300.0  # its imports: ~10 s on a GPU host
_POLL_S = 0.5
MEMORY_RECORD = "process-memory-mib.2"  # .2: not counting other models' loading processes
"""The file of a compile cache folder that holds what one process took on its card."""


async def use_fork_server(state: State) -> None:
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


async def start_all(state: State, cards: list[plan.Card], started: float) -> None:
    """Each model in turn (so that each one's memory on its cards is measured alone):
    its first process, until its model is loaded (compiled into the cache, its weights
    downloaded); then its others at once. The host's /healthz answers while the fork
    server imports."""
    await use_fork_server(state)
    state.baseline_mb = memory_used(cards)
    for model in state.models.values():
        if state.stop.is_set():
            return
        if not model.failed:
            await start_model(model, state, cards, started)


async def start_model(model: Model, state: State, cards: list[plan.Card], started: float) -> None:
    before = memory_used(cards)
    first = await _first_loaded(model, state, planned=bool(cards))
    if first is None:
        return
    model.loaded = True
    loaded_s = time.monotonic() - started
    if cards and recorded_memory(first.compile_cache) is None:
        await _others_loaded(model, state, first.slot.card)  # so that what grew is this one's
    rest = [c for c in model.children if c is not first and c not in state.retired]
    rest = _fit_in_memory(model, state, cards, first, rest, before)
    if model.failed:
        return
    log.info(
        "first process %s ready to share its compiled model after %.1f s; starting %d more",
        first.name,
        loaded_s,
        len(rest),
    )
    await asyncio.gather(*(child.start() for child in rest))


async def _first_loaded(model: Model, state: State, planned: bool) -> Child | None:
    """``model``'s first process, once it has loaded its model; None when none did.

    While none of its processes has loaded, a failed start of the first that restarting
    may cure (``failed_at_start``) counts as any process's does: it is started again with
    backoff until it fails the same way ``REPEATS`` times, and then its card is given up
    (no process loaded there: the others would load the same way), and the first
    process of the next card with processes left tries. With no card left, a host of one
    model stops with ``EXIT_NO_CARD``, a host file's model is left out. A status that
    restarting cannot change (``PERMANENT``: the model's own error) or Kafka unreachable
    stops the host, or leaves the model out, at once (``_first_failed``)."""
    failures = 0
    while (first := _next_first(model, state)) is not None:
        await first.start()
        if await _until_loaded(first, state, planned):
            state.failures.served(first.name)
            state.retrying.pop(first.name, None)
            return first
        if state.stop.is_set():
            return None
        status = await first.wait()
        if status in PERMANENT or status == EXIT_UNREACHABLE:
            _first_failed(model, state, status)
            return None
        if state.mps is not None:  # not counted: the MPS server may be what failed
            _without_mps(state, status)
            continue
        failures += 1
        if count_failed_start(first, status, state):  # its card given up
            failures = 0
            continue
        delay = backoff_s(failures)
        log.warning(
            "the first process %s of %s exited with status %s before it loaded (%s); "
            "starting it again in %.0f s",
            first.name, model.name, status, error_line(first.last_lines), delay,
        )  # fmt: skip
        if await _stopped_within(state, delay):
            return None
    if not state.stop.is_set():
        _no_card_left(model, state)
    return None


def _next_first(model: Model, state: State) -> Child | None:
    """The process of ``model`` to load it first: the first one not given up (on the
    first card with processes left)."""
    return next((c for c in model.children if c not in state.retired), None)


async def _stopped_within(state: State, delay: float) -> bool:
    """Wait ``delay`` seconds, or until the host is told to stop: whether it was."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.stop.wait(), delay)
    return state.stop.is_set()


def _no_card_left(model: Model, state: State) -> None:
    """Every card of ``model`` was given up before any of its processes loaded."""
    errors = sorted(set(state.failures.retired.get(c.name, "") for c in model.children) - {""})
    why = "; ".join(errors) or "no error line"
    if state.host is not None:
        left_out(state, model, f"its processes failed at start the same way on every card: {why}")
        return
    if state.failure is None:  # the tally said so first, in the usual case
        log.error(
            "no card of this host can serve: stopping the host (exit status %d)", EXIT_NO_CARD
        )
        state.failure = EXIT_NO_CARD
    state.stop.set()


def failed_at_start(child: Child, status: int) -> bool:
    """An error exit of a process before it was ever ready, once its model has loaded on
    another: one that a Kafka outage explains (status 4) does not count, nor a signal's
    (a kill, an out-of-memory kill). A model's first process counts every exit before it
    loads but those (``_first_failed``): nothing of the model serves yet."""
    return status > 0 and status != EXIT_UNREACHABLE and not child.ready_seen


def count_failed_start(child: Child, status: int, state: State) -> bool:
    """Count ``child``'s failed start; retire what the count condemns (``failing``), say
    why once, and stop the host when no card is left. Whether ``child`` was retired.

    Before any process of its model has loaded, a second process of a card failing as a
    retired one there did gives up the card at once: its others would load the same way
    (a card's model that fails on the first process it tries costs ``REPEATS`` + 1 starts,
    not ``REPEATS`` each)."""
    error = error_line(child.last_lines) if status >= 0 else f"killed by signal {-status}"
    newly = state.failures.failed(child.name, error)
    model = model_of(state, child)
    unloaded = model if model is not None and not model.loaded else None
    before = _failed_alike_before(state, child, error, unloaded)
    if unloaded is not None and before is not None:
        names = [c.name for c in unloaded.children if card_of(c.slot) == card_of(child.slot)]
        state.failures.retire(names, error)
        newly = [name for name in names if name not in {c.name for c in state.retired}]
    if not newly:
        alike = state.failures.count(child.name)
        state.retrying[child.name] = (
            f"process {child.name} failed at start {alike} time{'s' if alike > 1 else ''} "
            f"in a row (status {status}): {error}; started again until it fails alike "
            f"{REPEATS} times"
        )
        return False
    retired = [c for c in state.children if c.name in newly]
    state.retired.update(retired)
    for other in retired:
        state.retrying.pop(other.name, None)
        other.signal(signal.SIGTERM)  # a process of that card still starting
    if before is None:
        _say_retired(child, retired, status, error)
    else:
        _say_card_given_up(child, before, retired, status, error)
    _cards_changed(state)
    if unloaded is not None and (then := _next_first(unloaded, state)) is not None:
        log.info("model %s: %s loads it instead of %s", unloaded.name, then.name, child.name)
    return child in retired


def _failed_alike_before(
    state: State, child: Child, error: str, unloaded: Model | None
) -> Child | None:
    """Of ``unloaded`` (a model none of whose processes has loaded), the process of
    ``child``'s card that was retired for failing at start with ``error``, if any."""
    if unloaded is None:
        return None
    return next(
        (
            c
            for c in unloaded.children
            if c is not child
            and c in state.retired
            and card_of(c.slot) == card_of(child.slot)
            and state.failures.retired.get(c.name) == error
        ),
        None,
    )


def _cards_changed(state: State) -> None:
    """The cards' gauge after processes were retired; the host stopped when none is left."""
    if state.metrics is not None:
        failed = len(state.failures.failed_cards())
        state.metrics.set_cards(len(state.failures.serving_cards()), failed)
    if state.failures.none_serve:
        log.error(
            "no card of this host can serve: stopping the host (exit status %d)", EXIT_NO_CARD
        )
        state.failure = EXIT_NO_CARD
        state.stop.set()


def _say_retired(child: Child, retired: list[Child], status: int, error: str) -> None:
    """The one log line of a process, or a card, given up."""
    card = card_of(child.slot)
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


def _say_card_given_up(
    child: Child, before: Child, retired: list[Child], status: int, error: str
) -> None:
    """The one log line of a card given up before any process of its model loaded."""
    log.error(
        "%s: process %s failed at start as %s did (status %d): %s, and no process of the "
        "model has loaded: the card is given up, the model's %d other process%s there not "
        "started. The whole error is in their output above: fix its cause (a model or "
        "compile form that does not run on this card, too little memory on it), then "
        "restart the host",
        card_of(child.slot),
        child.name,
        before.name,
        status,
        error,
        len(retired) - 1,
        "" if len(retired) == 2 else "es",
    )


def card_of(slot: plan.Slot) -> str:
    """The card a process runs on, in words (the tally's and the log's)."""
    return "the CPU" if slot.card is None else f"GPU {slot.card}"


def tally(children: list[Child], before: StartFailures | None = None) -> StartFailures:
    """The failed starts of ``children``, by card (what ``before`` knew of them kept)."""
    cards: dict[str, list[str]] = {}
    for child in children:
        cards.setdefault(card_of(child.slot), []).append(child.name)
    return StartFailures(cards) if before is None else before.regrouped(cards)


def model_error_of_one_process(state: State, child: Child, status: int) -> bool:
    """A model error (status 2) of a process before it was ready, after another process
    of its model has loaded that model: it proves the model loads, so the failure is that
    process's or its card's (its start counts as failed), not the model's."""
    model = model_of(state, child)
    loaded = model is not None and model.loaded
    return status == EXIT_BAD_SETTINGS and loaded and not child.ready_seen


def model_of(state: State, child: Child) -> Model | None:
    """The model ``child`` serves (None: its model left the host file)."""
    return next((m for m in state.models.values() if child in m.children), None)


def _first_failed(model: Model, state: State, status: int) -> None:
    """A model's first process exited before it was ready, with a status that restarting
    cannot change: a host of one model stops with it; a host file's model is left out."""
    if state.host is None:
        log.error("the first worker process exited with status %s before it was ready", status)
        state.failure = status
        state.stop.set()
        return
    error = error_line(model.children[0].last_lines)
    left_out(state, model, f"its first process exited with status {status}: {error}")
    if state.stop.is_set():
        state.failure = status


def memory_used(cards: list[plan.Card]) -> dict[int, int]:
    """Each card's memory in use now (MiB), where nvidia-smi says."""
    used = {}
    for card in cards:
        now = gpus.memory_used_mb(card)
        if now is not None:
            used[card.index] = now
    return used


async def _until_loaded(child: Child, state: State, planned: bool) -> bool:
    """Whether ``child`` loaded and warmed up its model (its /readyz says so), or found its
    compile cache warm (nothing left to compile first; on cards, its memory a process
    recorded there too), before it exited or the host was told to stop."""
    deadline = time.monotonic() + FIRST_START_TIMEOUT_S
    while time.monotonic() < deadline and not state.stop.is_set():
        if not child.running:
            return False
        folder = child.compile_cache
        if (
            folder is not None
            and (folder / COMPILE_CACHE_WARM_MARK).exists()
            and (not planned or recorded_memory(folder) is not None)
        ):
            return True
        if child.port is not None and await _model_loaded(child.port):
            return True
        await asyncio.sleep(_POLL_S)
    return False


def recorded_memory(folder: Path | None) -> float | None:
    """MiB one process of the model took on its card at an earlier start, as recorded in
    its compile cache folder, or None."""
    if folder is None:
        return None
    try:
        value = float((folder / MEMORY_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


def _record_memory(folder: Path | None, process_mb: float) -> None:
    if folder is None:
        return
    try:
        (folder / MEMORY_RECORD).write_text(f"{process_mb:.0f}\n")
    except OSError:
        return  # a read-only cache: the next start measures again


async def _model_loaded(port: int) -> bool:
    try:
        _, body = await http_get(port, "/readyz")
        checks = json.loads(body).get("checks", {})
    except (OSError, TimeoutError, ValueError):
        return False
    return bool(checks.get("model_loaded") == "ok")


def _without_mps(state: State, status: int) -> None:
    """The first process failed under the supervisor's MPS server: run without it (the
    first process is started again)."""
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


def _fit_in_memory(
    model: Model,
    state: State,
    cards: list[plan.Card],
    first: Child,
    rest: list[Child],
    before: dict[int, int],
) -> list[Child]:
    """``rest``, without the processes its cards' memory cannot hold beside the host's
    other models; the model refused, with the numbers, when a count asked for does not
    fit or (``auto``) no process does. One process takes what its card's use grew by
    while ``first`` loaded, beyond the host's other processes there (loaded by now:
    ``_others_loaded``), recorded in the compile cache for the warm starts after it."""
    card = next((c for c in cards if c.index == first.slot.card), None)
    if card is None or card.index not in before:
        return rest
    process_mb = recorded_memory(first.compile_cache)
    how = "as recorded in its compile cache"
    if process_mb is None:
        # What the card's use grew by beyond the host's other processes there, counted at
        # what each takes loaded: those that were loading when ``first`` started grew too
        # (three Faster R-CNN processes made one ResNet-50 process look like 47,319 MiB).
        beside_mb = _in_use_beside(model, state, card, before)
        grown = memory_used(cards).get(card.index, beside_mb) - beside_mb
        if grown <= 0:
            return rest  # nothing measurable
        process_mb = float(grown)
        how = "measured on its first process"
        _record_memory(first.compile_cache, process_mb)
    model.process_mb = process_mb
    log.info("a process of %s takes %.0f MiB of its card, %s", model.name, process_mb, how)
    beside = [
        dataclasses.replace(c, used_mb=_in_use_beside(model, state, c, before)) for c in cards
    ]
    wanted: dict[int, int] = {}
    for child in model.children:
        if child.slot.card is not None and child not in state.retired:  # not a card given up
            wanted[child.slot.card] = wanted.get(child.slot.card, 0) + 1
    exact = model.settings.processes != "auto"
    fit, refused = plan.memory_plan(beside, wanted, process_mb, exact=exact)
    if refused:
        _refuse(model, state, refused)
        return []
    keep: list[Child] = []
    for candidate in beside:
        on_card = [
            c for c in model.children if c.slot.card == candidate.index and c not in state.retired
        ]
        if len(on_card) > fit.get(candidate.index, 0):
            log.warning(
                "GPU %d (%s) holds %d processes of %s of %.0f MiB each beside what is in use "
                "there (%d MiB), not %d: running %d",
                candidate.index, candidate.name, fit[candidate.index], model.name, process_mb,
                candidate.used_mb, len(on_card), fit[candidate.index],
            )  # fmt: skip
        keep += on_card[: fit.get(candidate.index, 0)]
    if first not in keep:
        state.retired.add(first)
        first.signal(signal.SIGTERM)
    model.children = [c for c in model.children if c in keep or c in state.retired]
    sync(state)
    return [c for c in rest if c in keep]


async def _others_loaded(model: Model, state: State, card: int | None) -> None:
    """Until the host's other models' processes on ``card`` have loaded (or exited, or
    ``FIRST_START_TIMEOUT_S`` passed): started before ``model``'s first process loaded,
    they may still be taking memory."""
    deadline = time.monotonic() + FIRST_START_TIMEOUT_S
    waiting = [
        child
        for other in state.models.values()
        if other is not model and not other.failed
        for child in other.children
        if child.slot.card == card
    ]
    while waiting and time.monotonic() < deadline and not state.stop.is_set():
        waiting = [
            child
            for child in waiting
            if child.running and (child.port is None or not await _model_loaded(child.port))
        ]
        if waiting:
            await asyncio.sleep(_POLL_S)


def _in_use_beside(model: Model, state: State, card: plan.Card, before: dict[int, int]) -> int:
    """MiB in use on ``card`` beside ``model``'s processes: what was measured before its
    first started, or what the host's other models' processes there take (measured once a
    process, as they may still be loading) above the host's own use, whichever is more."""
    planned = state.baseline_mb.get(card.index, 0) + sum(
        (other.process_mb or 0) * sum(1 for c in other.children if c.slot.card == card.index)
        for other in state.models.values()
        if other is not model and not other.failed
    )
    return int(max(before.get(card.index, card.used_mb), planned))


def _refuse(model: Model, state: State, why: str) -> None:
    """A model its cards cannot hold: a host of one model stops; a host file's model is
    left out, the others serve on."""
    if state.host is None:
        log.error("the model does not fit on its cards: %s", why)
        state.failure = EXIT_BAD_SETTINGS
        state.stop.set()
        return
    left_out(state, model, f"it does not fit on its cards: {why}")
