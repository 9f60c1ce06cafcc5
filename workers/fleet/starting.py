"""Starting a host's models: each one's first process, until its model is loaded, then
the others, as many as its cards' memory holds (``workers.fleet.supervisor``, step 4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
from pathlib import Path

from workers.config.worker import COMPILE_CACHE_WARM_MARK
from workers.exits import EXIT_BAD_SETTINGS, EXIT_UNREACHABLE, PERMANENT
from workers.fleet import gpus, plan
from workers.fleet.children import Child, http_get
from workers.fleet.failing import error_line
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
    first, *rest = model.children
    before = memory_used(cards)
    await first.start()
    planned = bool(cards)
    loaded = await _until_loaded(first, state, planned)
    if not loaded and state.mps is not None and not state.stop.is_set():
        status = await first.wait()
        if status in PERMANENT or status == EXIT_UNREACHABLE:  # not MPS's doing
            _first_failed(model, state, status)
            return
        await _without_mps(state, first, status)
        loaded = await _until_loaded(first, state, planned)
    if state.stop.is_set():
        return
    if not loaded:
        status = await first.wait()
        _first_failed(model, state, status if status > 0 else 1)
        return
    loaded_s = time.monotonic() - started
    if cards and recorded_memory(first.compile_cache) is None:
        await _others_loaded(model, state, first.slot.card)  # so that what grew is this one's
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


def _first_failed(model: Model, state: State, status: int) -> None:
    """A model's first process exited before it was ready: a host of one model stops
    with its status; a host file's model is left out."""
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


async def _without_mps(state: State, first: Child, status: int) -> None:
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
        if child.slot.card is not None:
            wanted[child.slot.card] = wanted.get(child.slot.card, 0) + 1
    exact = model.settings.processes != "auto"
    fit, refused = plan.memory_plan(beside, wanted, process_mb, exact=exact)
    if refused:
        _refuse(model, state, refused)
        return []
    keep: list[Child] = []
    for candidate in beside:
        on_card = [c for c in model.children if c.slot.card == candidate.index]
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
    model.children = [c for c in model.children if c in keep]
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
