"""Putting numbered items back in order: the reader's pure core, with no clock and no I/O."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_BUFFER = 1024
"""Items a reader holds at most while waiting for an earlier one."""


class ReorderBuffer(Generic[T]):
    """Hands out items numbered 0, 1, 2, ... in order, whatever order they are added in.

    A pure core with no clock and no I/O: the reader decides when a gap has
    lasted long enough to give up on it (``skip_gap``). Items below the next
    number (late or duplicate) are ignored, and so is a second item with a
    number already held: the first one wins, as for results in Redis.
    """

    def __init__(self, start_seq: int = 0, capacity: int = DEFAULT_BUFFER) -> None:
        """``start_seq``: the first number handed out; ``capacity``: most items held at once."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.next_seq = start_seq
        """The number handed out next."""
        self.capacity = capacity
        self._held: dict[int, T] = {}

    @property
    def held(self) -> int:
        """How many items wait for an earlier one."""
        return len(self._held)

    @property
    def full(self) -> bool:
        """Whether ``capacity`` items are held: the gap before them should be skipped."""
        return len(self._held) >= self.capacity

    def add(self, seq: int, item: T) -> bool:
        """Hold ``item`` until its turn; False when it is ignored (late or a duplicate)."""
        if seq < self.next_seq or seq in self._held:
            return False
        self._held[seq] = item
        return True

    def pop_ready(self) -> list[tuple[int, T]]:
        """The items that are next in order, removed from the buffer."""
        ready = []
        while self.next_seq in self._held:
            ready.append((self.next_seq, self._held.pop(self.next_seq)))
            self.next_seq += 1
        return ready

    def skip_gap(self) -> range:
        """Give up on the numbers missing before the lowest held item; returns them.

        Empty when nothing is held: with no later item there is no gap yet.
        """
        if not self._held:
            return range(0)
        missing = range(self.next_seq, min(self._held))
        self.next_seq = missing.stop
        return missing
