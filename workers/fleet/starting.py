"""Starting a host's models: each one's first process, until its model is loaded, then
the others, as many as its cards' memory holds (``workers.fleet.supervisor``, step 4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from workers.config.worker import COMPILE_CACHE_WARM_MARK
from workers.exits import EXIT_UNREACHABLE, PERMANENT
from workers.fleet import gpus, plan
from workers.fleet.children import Child, http_get
from workers.fleet.failing import error_line
from workers.fleet.state import Model, State, left_out, sync

log = logging.getLogger("conveyor.fleet")

FIRST_START_TIMEOUT_S = 900.0  # a cold compile of a large model on a slow host
FORK_SERVER_TIMEOUT_S = 300.0  # its imports: ~10 s on a GPU host
_POLL_S = 0.5


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
    for model in state.models.values():
        if state.stop.is_set():
            return
        if not model.failed:
            await start_model(model, state, cards, started)


async def start_model(model: Model, state: State, cards: list[plan.Card], started: float) -> None:
    first, *rest = model.children
    before = memory_used(cards)
    await first.start()
    loaded = await _until_loaded(first, state)
    if not loaded and state.mps is not None and not state.stop.is_set():
        status = await first.wait()
        if status in PERMANENT or status == EXIT_UNREACHABLE:  # not MPS's doing
            _first_failed(model, state, status)
            return
        await _without_mps(state, first, status)
        loaded = await _until_loaded(first, state)
    if state.stop.is_set():
        return
    if not loaded:
        status = await first.wait()
        _first_failed(model, state, status if status > 0 else 1)
        return
    log.info(
        "first process %s ready to share its compiled model after %.1f s; starting %d more",
        first.name,
        time.monotonic() - started,
        len(rest),
    )
    rest = _fit_in_memory(model, state, cards, first, rest, before)
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


async def _until_loaded(child: Child, state: State) -> bool:
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
    """``rest``, without the processes its cards' memory cannot hold (``auto`` only): one
    process takes what its card's use grew by while ``first`` loaded, beside what was in
    use before (the host's other models included)."""
    card = next((c for c in cards if c.index == first.slot.card), None)
    if model.settings.processes != "auto" or card is None or card.index not in before:
        return rest
    now = memory_used(cards)
    if card.index not in now:
        return rest
    one = now[card.index] - before[card.index]
    keep = [first]
    for candidate in cards:
        wanted = [c for c in rest if c.slot.card == candidate.index]
        if not wanted:
            continue
        if candidate.index == card.index:  # beside what was in use before the first loaded
            room = dataclasses.replace(candidate, used_mb=before[card.index])
            fit = plan.fit_in_memory(room, one, len(wanted) + 1) - 1
        else:
            used = now.get(candidate.index, candidate.used_mb)
            fit = plan.fit_in_memory(dataclasses.replace(candidate, used_mb=used), one, len(wanted))
        if fit < len(wanted):
            log.warning(
                "GPU %d (%s) holds %d more processes of %s of %d MiB each, not %d: running %d",
                candidate.index, candidate.name, fit, model.name, one, len(wanted), fit,
            )  # fmt: skip
        keep += wanted[:fit]
    model.children = [c for c in model.children if c in keep]
    sync(state)
    return [c for c in rest if c in keep]
