"""Reading a generation's stream: its text as it is made (``client.stream``).

A generation model's worker writes each request's events to the Redis Stream
``conveyor:stream:{<request id>}`` (docs/contract.md, Streams): ``start``, ``chunk``,
``end`` or ``error``, each naming its ``run``. A ``start`` after another means the
request is being generated again (a worker was killed mid-generation): the text of
the run before is void, and ``StreamEvent.restarted`` says so, so that a reader
starts over instead of splicing two generations into one text.

The reader ends at the ``end`` or ``error`` of the latest run; or, when the stream
is silent and the request already has its result (it was refused before it was
generated, say), at once. The result document stays the answer: read it with
``client.wait``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from producers.errors import ResultTimeout
from schemas import stream_key

BLOCK_MS = 1_000  # one XREAD waits at most this long, then the result is looked for
COUNT = 256


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a generation's stream."""

    type: str  # start, chunk, end, error
    run: str
    text: str = ""
    attempt: int | None = None
    restarted: bool = False  # a start that voids the text of the run before
    finish_reason: str | None = None
    code: str | None = None
    message: str | None = None

    @property
    def last(self) -> bool:
        return self.type in ("end", "error")


ReadStream = Callable[[str, str, int, int], Awaitable[list[tuple[str, Mapping[str, str]]]]]
"""(key, last id, block ms, count) → entries after ``last id``: one XREAD."""
HasResult = Callable[[], Awaitable[bool]]


async def stream_events(
    request_id: str, read: ReadStream, has_result: HasResult, timeout_s: float
) -> AsyncGenerator[StreamEvent, None]:
    """The events of ``request_id``'s stream from its start, as they come; raises
    ``ResultTimeout`` when it has not ended within ``timeout_s`` seconds."""
    key = stream_key(request_id)
    give_up = time.monotonic() + timeout_s
    last_id, current, started = "0-0", None, False
    while True:
        left = give_up - time.monotonic()
        if left <= 0:
            raise ResultTimeout([request_id], timeout_s)
        entries = await read(key, last_id, max(1, min(BLOCK_MS, int(left * 1000))), COUNT)
        if not entries:
            if current is None and await has_result():
                return  # answered without a generation (refused, or long expired)
            continue
        for entry_id, fields in entries:
            last_id = entry_id
            event = _event(fields, restarted=started)
            if event.type == "start":
                current, started = event.run, True
            elif event.run != current:
                continue  # a late write of a run that another replaced
            yield event
            if event.last:
                return


def _event(fields: Mapping[str, str], *, restarted: bool) -> StreamEvent:
    kind = fields.get("type", "")
    attempt = fields.get("attempt")
    return StreamEvent(
        type=kind,
        run=fields.get("run", ""),
        text=fields.get("text", ""),
        attempt=int(attempt) if attempt and attempt.isdigit() else None,
        restarted=restarted and kind == "start",
        finish_reason=fields.get("finish_reason"),
        code=fields.get("code"),
        message=fields.get("message"),
    )
