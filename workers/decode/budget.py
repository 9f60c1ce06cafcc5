"""A bound on the memory of images being decoded at once, across the decode threads.

A payload's declared size is checked against ``max_pixels`` before it is decoded,
which bounds one image; this bounds their sum, however many threads decode.
``workers.decode.images`` holds an image's estimated peak while it decodes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class DecodeBudget:
    """A bound on the bytes of images being decoded at once, shared by the decode threads.

    Each decode holds an estimate of its peak memory (the decoded pixels plus their
    conversion to the model's mode) while it runs; a decode that does not fit waits
    until others finish, so ``limit`` bounds the sum however many threads decode.
    One image larger than the whole budget waits until it can run alone. Nothing is
    ever refused here: ``max_pixels`` refuses, the budget only makes requests wait.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a decode budget needs at least 1 byte, got {limit_bytes}")
        self.limit = limit_bytes
        self._used = 0
        self._room = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Wait for ``nbytes`` of room (all of it, above the limit) and hold it."""
        nbytes = min(max(nbytes, 0), self.limit)
        with self._room:
            self._room.wait_for(lambda: self._used + nbytes <= self.limit)
            self._used += nbytes
        try:
            yield
        finally:
            with self._room:
                self._used -= nbytes
                self._room.notify_all()

    @property
    def used(self) -> int:
        """Bytes held now (for tests and metrics)."""
        return self._used
