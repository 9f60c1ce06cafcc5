"""The output processor: each step's tokens into per-request text deltas, then one final.

The engine reports, per running request and step, every token made so far. For each
request a ``Detokenized`` keeps the text sent so far and turns the new tokens into
the next chunk: it decodes the tokens after the prompt (special tokens skipped) and
holds back what may still change, a trailing incomplete UTF-8 sequence and any tail
that could be the start of a stop string. So the chunks, joined, are exactly the
final text, and a stop string never reaches a reader before it is cut.

``final`` builds the output of the result document: the whole text, token counts,
the finish reason and the time to the first token and between tokens (from the
engine's own per-token timestamps).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

Decode = Callable[[list[int]], str]

STOP = "stop"  # an end-of-sequence token or a stop string
LENGTH = "length"  # max_new_tokens made


@dataclass(slots=True)
class Step:
    """What one engine step changed for one request: its next chunk, if any."""

    chunk: str
    stopped: str | None  # the stop string that ended the text, if one did


class Detokenized:
    """One request's text, as it grows step by step."""

    def __init__(self, decode: Decode, stops: Sequence[str], eos: Collection[int]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._eos = frozenset(eos)
        self.tokens: list[int] = []
        self.text = ""  # the text so far (cut at a stop string once one appeared)
        self.sent = 0  # characters of ``text`` already sent as chunks
        self.stopped: str | None = None

    def update(self, tokens: Sequence[int]) -> Step:
        """Take every token made so far; the chunk that is now safe to send."""
        if self.stopped is not None:  # the engine may run a step past the stop
            return Step("", self.stopped)
        self.tokens = list(tokens)
        text = self._decode([t for t in self.tokens if t not in self._eos])
        cut = self._first_stop(text)
        if cut is not None:
            at, stop = cut
            self.text, self.stopped = text[:at], stop
            return Step(self._flush(), stop)
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):  # a character whose bytes are not all made yet
            safe = len(text.rstrip("\ufffd"))
        if self._stops:
            safe = min(safe, self._unstoppable(text))
        return Step(self._advance(max(safe, self.sent)), None)

    def finish(self) -> str:
        """The rest of the text, at the end: nothing is held back any more."""
        return self._flush()

    def _flush(self) -> str:
        return self._advance(len(self.text))

    def _advance(self, upto: int) -> str:
        chunk = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return chunk

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string starts (searched from the text not yet sent)."""
        start = max(0, self.sent - self._hold)
        found = [(at, s) for s in self._stops if (at := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _unstoppable(self, text: str) -> int:
        """The length of ``text`` that no stop string can start in: a tail that is a
        prefix of one stays back until the next tokens say."""
        for back in range(min(self._hold, len(text)), 0, -1):
            tail = text[-back:]
            if any(s.startswith(tail) for s in self._stops):
                return len(text) - back
        return len(text)


def final(
    text: Detokenized,
    *,
    prompt_tokens: int,
    finish_reason: str,
    created_s: float,
    timestamps: Sequence[float] | None,
    attempt: int,
    token_ids: bool = False,
) -> dict[str, Any]:
    """The ``outputs`` of a finished generation's result document.

    ``created_s`` is when the request joined the engine and ``timestamps`` when each
    token was made (``time.perf_counter`` seconds, the engine's clock)."""
    out: dict[str, Any] = {
        "text": text.text,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(text.tokens),
        "attempt": attempt,
    }
    if text.stopped is not None:
        out["stop"] = text.stopped
    if timestamps:
        out["time_to_first_token_ms"] = round((timestamps[0] - created_s) * 1000.0, 3)
        gaps = [(b - a) * 1000.0 for a, b in itertools.pairwise(timestamps)]
        if gaps:
            out["time_between_tokens_ms"] = {
                "mean": round(statistics.fmean(gaps), 3),
                "p50": round(statistics.median(gaps), 3),
                "max": round(max(gaps), 3),
            }
    if token_ids:
        out["token_ids"] = list(text.tokens)
    return out
