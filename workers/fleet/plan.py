"""How many worker processes a host runs, on which cards, under which names: pure rules.

``processes auto`` decides per card, from what the host has:

- **cores**: one process a CPU core the supervisor may use (its affinity), shared
  out over the cards. A process is one event loop that fetches, parses and
  publishes for its batches: one process feeds a card only as fast as its loop
  runs (on an H100 one process reached 0.37 of the 640x480 ceiling, its loop busy
  half the time at a third of the card's rate; four 0.67; eight 0.98:
  docs/benchmarks.md);
- **at most ``MAX_PER_CARD``** (8) a card: eight reached the card's ceiling on
  every corpus measured, and each more process holds its own model, CUDA graphs
  and compile-time memory on the card;
- **every model of a host file the same**: the models on a card each get that count,
  not a share of it, as long as MPS takes them all (``MPS_CLIENTS`` a card). A model
  without requests costs its processes no CPU, and when all are busy the card is
  time-shared, so the processes' work on the CPU is about one model's at full rate.
  Halving the count made the model left busy run at half the processes once the
  other's backlog ran out: two models on one H200 reached 0.884 of perfect
  time-sharing with four processes each (docs/bench-log, 2026-11-29);
- **memory**: no more than the card's free memory holds beside the host's other models,
  one process measured on the running host once the first has loaded and warmed up its
  model, and recorded in the compile cache for warm starts (``memory_plan``). A count
  that was asked for and does not fit refuses the model, with the numbers.

On the CPU, ``auto`` is one process: the model's own threads use the cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_PER_CARD = 8
"""``auto``'s most processes on one card."""

MPS_CLIENTS = 48
"""Client processes one MPS server takes on a card (Volta and later); ``auto`` stays
within it however many models share the card."""

MEMORY_HEADROOM = 0.9
"""Share of a card's memory the processes may fill; the rest absorbs their growth."""


@dataclass(frozen=True, slots=True)
class Card:
    """One visible GPU: its index as CUDA numbers it here, its name and memory (MiB), and
    its UUID (what ``CUDA_VISIBLE_DEVICES`` names it by, whatever the numbering)."""

    index: int
    name: str
    memory_mb: int
    used_mb: int = 0
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class Slot:
    """The place of one worker process: its card (None: the CPU) and its number there."""

    card: int | None
    number: int

    @property
    def device(self) -> str:
        return "cpu" if self.card is None else f"cuda:{self.card}"

    def name(self, base: str) -> str:
        """``<base>-<card>-<number>``: the process's group instance id and worker id."""
        where = "cpu" if self.card is None else str(self.card)
        return f"{base}-{where}-{self.number}"


def parse_processes(value: str) -> int | None:
    """The ``processes`` setting (validated: ``auto`` or a number): None for ``auto``."""
    return None if value == "auto" else int(value)


def chosen_cards(gpus: str, device: str, visible: Sequence[Card]) -> list[Card]:
    """The cards to run on: none for ``device`` cpu; ``cuda:N`` alone; else ``gpus``
    (``all``, or indices such as ``0,1`` among the visible ones). Raises ValueError
    naming the cards that do not exist."""
    if device == "cpu":
        return []
    by_index = {card.index: card for card in visible}
    if device.startswith("cuda:"):
        wanted = [int(device.partition(":")[2])]
    elif gpus == "all":
        return list(visible)
    else:
        wanted = [int(part) for part in gpus.split(",")]
    missing = [index for index in wanted if index not in by_index]
    if missing:
        seen = ", ".join(str(card.index) for card in visible) or "none"
        raise ValueError(f"no GPU {missing[0]} on this host (visible: {seen})")
    return [by_index[index] for index in dict.fromkeys(wanted)]


def per_card(processes: int | None, cards: int, cores: int, models: int = 1) -> int:
    """Processes on each card (``processes`` None: auto, before the memory measurement),
    for one of ``models`` that share the cards."""
    if cards < 1:
        raise ValueError("per_card needs at least one card")
    if processes is not None:
        return max(1, -(-processes // cards))  # the total, spread; the last cards may get fewer
    return max(1, min(MAX_PER_CARD, cores // cards, MPS_CLIENTS // max(1, models)))


def slots(processes: int | None, cards: Sequence[Card], cores: int, models: int = 1) -> list[Slot]:
    """Every process's place, card by card in turn (so a partial count spreads evenly)."""
    if not cards:
        return [Slot(None, n) for n in range(processes or 1)]
    each = per_card(None, len(cards), cores, models)
    count = processes if processes is not None else each * len(cards)
    return [Slot(cards[k % len(cards)].index, k // len(cards)) for k in range(count)]


def fit_in_memory(card: Card, process_mb: float, wanted: int) -> int:
    """How many of ``wanted`` processes fit on ``card`` when each takes ``process_mb``
    (its model, graphs and workspace, measured), beside what is in use there
    (``used_mb``), within ``MEMORY_HEADROOM`` of the card."""
    if process_mb <= 0:
        return wanted
    return max(0, min(wanted, int(room_mb(card) // process_mb)))


def room_mb(card: Card) -> float:
    """What processes may still fill on ``card``: its headroom less what is in use."""
    return max(0.0, card.memory_mb * MEMORY_HEADROOM - card.used_mb)


def memory_plan(
    cards: Sequence[Card], wanted: Mapping[int, int], process_mb: float, *, exact: bool
) -> tuple[dict[int, int], str]:
    """Each card's processes of one model (``wanted``: by card index) when each takes
    ``process_mb``, beside what is in use on each card (``used_mb``: the host's other
    models); and why the model is refused, or "": a count that was asked for
    (``exact``) and that a card cannot hold, or, for ``auto``, no process anywhere."""
    fit = {
        c.index: fit_in_memory(c, process_mb, wanted[c.index]) for c in cards if wanted.get(c.index)
    }
    short = [c for c in cards if c.index in fit and fit[c.index] < wanted[c.index]]
    if not short or (not exact and any(fit.values())):
        return fit, ""
    card = short[0]
    need = wanted[card.index] * process_mb
    return fit, (
        f"{wanted[card.index]} process(es) of {process_mb:,.0f} MiB each need {need:,.0f} MiB "
        f"on GPU {card.index} ({card.name}), which has {room_mb(card):,.0f} MiB left for them "
        f"({MEMORY_HEADROOM:.0%} of its {card.memory_mb:,} MiB, {card.used_mb:,} MiB in use "
        f"beside them); "
        + (
            "lower its processes or give it a card of its own"
            if exact
            else "give it a card of its own"
        )
    )


def decode_threads(cores: int, processes: int) -> int:
    """Each process's share of the cores for CPU decoding (at least one thread)."""
    return max(1, cores // max(1, processes))
