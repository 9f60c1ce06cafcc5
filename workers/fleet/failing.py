"""Which of a host's worker processes the supervisor stops starting again: pure rules.

A process that exits with an error before it was ever ready failed at start.
Starting it again helps when the cause passes; it does not when the cause is the
card or the model on it (a compiled artifact that is not valid there, memory the
card lacks, a driver that refuses it). Then every start fails the same way, each
start rejoins the group under the process's static membership and holds its
partitions away from the processes that serve, and the host is never ready. So:

- a process whose last ``REPEATS`` starts failed with the same error is **retired**:
  not started again;
- a card whose processes' latest starts all failed with the same error, ``REPEATS``
  failed starts among them at least, is retired at once, every process of it (eight
  processes failing alike prove as much as one failing three times);
- a card all of whose processes are retired has **failed**; a host all of whose
  cards have failed cannot serve (the supervisor exits ``EXIT_NO_CARD``).

A start that reaches ready clears its process's record. "The same error" is the
last error line of the process's output (``error_line``). The supervisor decides
what counts as a failed start (an exit status that restarting may cure, such as
Kafka being unreachable, does not count); this class only keeps the tally.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

REPEATS = 3
"""Failed starts in a row, with the same error, after which a process is retired."""
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
"""A process that exits is started again after 1 s, doubling to 30 s."""


def backoff_s(failures: int) -> float:
    """The wait before starting a process again after its ``failures``-th exit in a row."""
    return min(BACKOFF_MAX_S, BACKOFF_START_S * 2.0 ** (failures - 1))


_ERROR = re.compile(r"Error\b|Exception\b|^conveyor worker: |\berror\b", re.IGNORECASE)
_MAX_LINE = 300


def error_line(lines: Iterable[str]) -> str:
    """The line of a process's last output that says what went wrong: the last one that
    names an error (a traceback's last line, the worker's own ``conveyor worker: ...``),
    else the last non-empty one; cut to 300 characters."""
    kept = [line.strip() for line in lines if line.strip()]
    errors = [line for line in kept if _ERROR.search(line)]
    chosen = errors[-1] if errors else (kept[-1] if kept else "no output")
    return chosen if len(chosen) <= _MAX_LINE else chosen[: _MAX_LINE - 1] + "…"


class StartFailures:
    """The failed starts of a host's processes, by card (``cards``: card label → the
    names of its processes; a CPU host is one card, ``cpu``)."""

    def __init__(self, cards: Mapping[str, Sequence[str]], repeats: int = REPEATS) -> None:
        self._cards = {card: list(names) for card, names in cards.items()}
        self._card_of = {name: card for card, names in cards.items() for name in names}
        self._repeats = repeats
        self._streaks: dict[str, tuple[str, int]] = {}  # process → (error, failed starts)
        self.retired: dict[str, str] = {}
        """Processes not to start again → the error they failed with."""

    def failed(self, process: str, error: str) -> list[str]:
        """Record a failed start of ``process``; the processes retired by it (none,
        ``process`` alone, or every process of its card)."""
        if process in self.retired:
            return []
        last, count = self._streaks.get(process, (error, 0))
        count = count + 1 if last == error else 1
        self._streaks[process] = (error, count)
        card = self._card_of[process]
        alike = [self._streaks.get(name, ("", 0)) for name in self._cards[card]]
        if (
            all(streak[1] > 0 and streak[0] == error for streak in alike)
            and sum(streak[1] for streak in alike) >= self._repeats
        ):
            newly = [name for name in self._cards[card] if name not in self.retired]
        elif count >= self._repeats:
            newly = [process]
        else:
            return []
        for name in newly:
            self.retired[name] = error
        return newly

    def retire(self, processes: Sequence[str], error: str) -> None:
        """Retire ``processes`` at once, with ``error`` (a model's first process failed
        alike ``REPEATS`` times on a card where none of its processes has loaded: the
        others there would load the same way)."""
        for name in processes:
            self.retired.setdefault(name, error)

    def count(self, process: str) -> int:
        """``process``'s failed starts in a row with the same error, so far."""
        return self._streaks.get(process, ("", 0))[1]

    def regrouped(self, cards: Mapping[str, Sequence[str]]) -> StartFailures:
        """The tally over ``cards`` (the host's processes changed: some did not fit in
        memory), keeping what is known of the processes still there."""
        fresh = StartFailures(cards, self._repeats)
        fresh._streaks = {n: s for n, s in self._streaks.items() if n in fresh._card_of}
        fresh.retired = {n: e for n, e in self.retired.items() if n in fresh._card_of}
        return fresh

    def served(self, process: str) -> None:
        """``process`` reached ready: its failed starts so far no longer count."""
        self._streaks.pop(process, None)

    def failed_cards(self) -> dict[str, str]:
        """Cards all of whose processes are retired → the error of the last one retired."""
        return {
            card: self.retired[names[-1]]
            for card, names in self._cards.items()
            if names and all(name in self.retired for name in names)
        }

    def serving_cards(self) -> list[str]:
        failed = self.failed_cards()
        return [card for card in self._cards if card not in failed]

    @property
    def none_serve(self) -> bool:
        """Every card has failed: nothing on this host can serve."""
        return bool(self._cards) and not self.serving_cards()
