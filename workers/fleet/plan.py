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
- **memory**: no more than the card's free memory holds, measured on the running
  host once the first process has loaded and warmed up its model (``fit_in_memory``).

On the CPU, ``auto`` is one process: the model's own threads use the cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_PER_CARD = 8
"""``auto``'s most processes on one card."""

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


def per_card(processes: int | None, cards: int, cores: int) -> int:
    """Processes on each card (``processes`` None: auto, before the memory measurement)."""
    if cards < 1:
        raise ValueError("per_card needs at least one card")
    if processes is not None:
        return max(1, -(-processes // cards))  # the total, spread; the last cards may get fewer
    return max(1, min(MAX_PER_CARD, cores // cards))


def slots(processes: int | None, cards: Sequence[Card], cores: int) -> list[Slot]:
    """Every process's place, card by card in turn (so a partial count spreads evenly)."""
    if not cards:
        return [Slot(None, n) for n in range(processes or 1)]
    count = processes if processes is not None else per_card(None, len(cards), cores) * len(cards)
    return [Slot(cards[k % len(cards)].index, k // len(cards)) for k in range(count)]


def fit_in_memory(card: Card, first_mb: float, wanted: int) -> int:
    """How many of ``wanted`` processes fit on ``card`` when one takes ``first_mb`` (its
    model, graphs and workspace, measured), beside what was in use before (``used_mb``)."""
    if first_mb <= 0:
        return wanted
    room = card.memory_mb * MEMORY_HEADROOM - card.used_mb
    return max(1, min(wanted, int(room // first_mb)))


def decode_threads(cores: int, processes: int) -> int:
    """Each process's share of the cores for CPU decoding (at least one thread)."""
    return max(1, cores // max(1, processes))
