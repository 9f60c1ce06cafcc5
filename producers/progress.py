"""A one-line progress bar for the terminal, redrawn in place on stderr."""

from __future__ import annotations

import time
from typing import TextIO

_WIDTH = 30
_REDRAW_EVERY_S = 0.1  # a redraw per result would cost more than the work on fast runs


class ProgressBar:
    """``[#####.....]  12/40 results`` on one line of ``stream``; ``close()`` ends the line."""

    def __init__(self, total: int, label: str, stream: TextIO) -> None:
        self._total = total
        self._label = label
        self._stream = stream
        self._done = 0
        self._drawn_at = -_REDRAW_EVERY_S

    def advance(self, count: int = 1) -> None:
        self._done += count
        now = time.monotonic()
        if now - self._drawn_at >= _REDRAW_EVERY_S or self._done >= self._total:
            self._draw()
            self._drawn_at = now

    def close(self) -> None:
        self._draw()
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self) -> None:
        filled = _WIDTH * self._done // max(self._total, 1)
        bar = "#" * filled + "." * (_WIDTH - filled)
        self._stream.write(f"\r[{bar}] {self._done:>{len(str(self._total))}}/{self._total} ")
        self._stream.write(self._label)
        self._stream.flush()
