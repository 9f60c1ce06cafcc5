"""A model's first process that fails at start, on a host of several cards
(``workers.fleet.starting``): its starts are counted, its card is given up once a second
process there fails alike, the next card's first process loads the model, and a host
with no card left exits 8. Processes are stand-ins (a GPU host's cards cannot be had on
the CPU); tests/integration/test_fleet.py runs real ones on the CPU. Also: which load
failures are the card's (``device_fault``), and what the loader lets through."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from schemas import Limits
from workers.config.worker import COMPILE_CACHE_WARM_MARK, WorkerSettings
from workers.exits import EXIT_BAD_SETTINGS, EXIT_NO_CARD
from workers.fleet import starting
from workers.fleet.children import Child
from workers.fleet.failing import StartFailures, backoff_s
from workers.fleet.plan import Slot
from workers.fleet.state import Model, State, sync
from workers.handlers.weights import ModelLoadError
from workers.model.loader import device_fault, load_handler

DRIVER = "RuntimeError: CUDA driver error: invalid argument"


class StandIn(Child):
    """A process that loads (its compile cache warm) or exits with ``status`` at once."""

    def __init__(self, slot: Slot, folder: Path, status: int) -> None:
        super().__init__(slot, slot.name("h"), "m", [], {}, json=False)
        self.status = status
        self.up = False
        self.folder = folder

    async def start(self) -> None:
        self.starts += 1
        self.up = self.status == 0
        self.last_lines.clear()
        if self.status:
            self.last_lines.append(DRIVER)
        else:  # loaded: its compile cache marked warm
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / COMPILE_CACHE_WARM_MARK).touch()
            self.compile_cache = self.folder

    @property
    def running(self) -> bool:
        return self.up

    async def wait(self) -> int:
        return self.status

    def signal(self, signum: object) -> None:
        self.up = False


def host(tmp_path: Path, failing: set[int], model: str = "m") -> tuple[State, list[StandIn]]:
    """Two cards of two processes each; the cards in ``failing`` fail every start alike."""
    children = [
        StandIn(Slot(card, n), tmp_path / f"{card}-{n}", 9 if card in failing else 0)
        for card in (0, 1)
        for n in range(2)
    ]
    served = Model(WorkerSettings(model="demo:digits", model_name=model), [])
    served.children = list(children)
    state = State(models={served.name: served})
    sync(state)
    state.failures = starting.tally(state.children)
    return state, children


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starting, "backoff_s", lambda failures: 0.0)


def test_the_first_process_failing_alike_gives_up_its_card_and_the_next_card_loads(
    tmp_path: Path,
) -> None:
    state, children = host(tmp_path, failing={0})
    [model] = state.models.values()
    asyncio.run(starting.start_model(model, state, [], 0.0))
    assert [c.starts for c in children] == [3, 1, 1, 1]  # 3 starts, then one confirms the card
    assert {c.name for c in state.retired} == {"h-0-0", "h-0-1"}
    assert state.failures.failed_cards() == {"GPU 0": DRIVER}
    assert state.failures.serving_cards() == ["GPU 1"]
    assert model.loaded
    assert state.failure is None
    assert not state.stop.is_set()
    assert state.retrying == {}


def test_a_process_failing_alone_while_its_cards_next_one_loads_is_retired_alone(
    tmp_path: Path,
) -> None:
    state, children = host(tmp_path, failing=set())
    children[0].status = 9  # the first process alone: its card's next one loads
    [model] = state.models.values()
    asyncio.run(starting.start_model(model, state, [], 0.0))
    assert [c.starts for c in children] == [3, 1, 1, 1]
    assert {c.name for c in state.retired} == {"h-0-0"}
    assert state.failures.failed_cards() == {}
    assert state.failure is None


def test_a_host_of_one_model_whose_every_card_fails_exits_no_card(tmp_path: Path) -> None:
    state, children = host(tmp_path, failing={0, 1})
    [model] = state.models.values()
    asyncio.run(starting.start_model(model, state, [], 0.0))
    assert [c.starts for c in children] == [3, 1, 3, 1]
    assert state.failure == EXIT_NO_CARD
    assert state.stop.is_set()
    assert not model.loaded


def test_readyz_says_why_while_the_first_process_is_retried(tmp_path: Path) -> None:
    from workers.fleet.supervisor import _cards_serving

    state, children = host(tmp_path, failing={0})
    assert _cards_serving(state) is True
    children[0].last_lines.append(DRIVER)  # its output's last line
    assert not starting.count_failed_start(children[0], 9, state)
    said = _cards_serving(state)
    assert said == (
        f"process h-0-0 failed at start 1 time in a row (status 9): {DRIVER}; started again "
        "until it fails alike 3 times"
    )


def test_a_model_error_of_a_later_process_is_its_own_once_the_model_loaded(
    tmp_path: Path,
) -> None:
    state, children = host(tmp_path, failing=set())
    [model] = state.models.values()
    assert not starting.model_error_of_one_process(state, children[1], EXIT_BAD_SETTINGS)
    model.loaded = True  # another process loaded it: the model loads
    assert starting.model_error_of_one_process(state, children[1], EXIT_BAD_SETTINGS)
    assert not starting.model_error_of_one_process(state, children[1], 3)  # topics: the host's
    children[1].ready_seen = True  # it served, then failed: not a failed start
    assert not starting.model_error_of_one_process(state, children[1], EXIT_BAD_SETTINGS)


def test_the_tally_regrouped_keeps_what_it_knew_and_retires_on_request() -> None:
    failures = StartFailures({"GPU 0": ["a", "b"], "GPU 1": ["c"]})
    failures.failed("a", DRIVER)
    assert failures.count("a") == 1
    failures.retire(["c"], DRIVER)
    fewer = failures.regrouped({"GPU 0": ["a"], "GPU 1": ["c"]})  # b did not fit
    assert fewer.count("a") == 1
    assert fewer.failed_cards() == {"GPU 1": DRIVER}
    assert [backoff_s(n) for n in (1, 2, 3, 6, 7)] == [1.0, 2.0, 4.0, 30.0, 30.0]


@pytest.mark.parametrize(
    ("exc", "cards"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (MemoryError(), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA driver error: invalid argument"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("no such checkpoint key"), False),
        (KeyError("fc.weight"), False),
    ],
)
def test_memory_and_device_errors_are_the_cards(exc: BaseException, cards: bool) -> None:
    assert device_fault(exc) is cards


class OutOfMemoryAtInit:
    def __init__(self) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class BrokenAtInit:
    def __init__(self) -> None:
        raise ValueError("no such checkpoint key")


def load(spec: str) -> object:
    return load_handler(
        spec, device="cpu", weights=None, dtype="auto", channels_last=None, limits=Limits()
    )


def test_the_loader_lets_a_cards_error_through_and_names_a_models() -> None:
    with pytest.raises(torch.OutOfMemoryError):  # the worker exits 9 for it (workers.app)
        load(f"{__name__}:{OutOfMemoryAtInit.__name__}")
    with pytest.raises(ModelLoadError, match="creating BrokenAtInit failed"):  # exit 2
        load(f"{__name__}:{BrokenAtInit.__name__}")
