"""Child requests: what one model's worker sends the next model of a pipeline.

A worker with a next stage (``conveyor worker --then MODEL``) turns each answered
request (the *parent*) into child requests on the next model's request topic: one
crop per selected box. A child is an ordinary v1 request (its own ``ce_id``, an
image payload) with three more headers that tie it to its parent:

| header | value |
|---|---|
| ``ce_parent`` | the parent's request id |
| ``ce_index`` | the child's place among its parent's children: 0, 1, ... |
| ``ce_count`` | how many children the parent has |

The worker that answers a child does not write the child's result under the
child's id: it adds it to the parent's join (the Redis hash ``join_key(parent)``),
and the worker that adds the last child writes the parent's one result
(docs/contract.md, "Pipelines"). Pure: names and parsing, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from schemas.naming import is_valid_request_id

PARENT_H: Final = "ce_parent"
INDEX_H: Final = "ce_index"
COUNT_H: Final = "ce_count"
JOIN_PREFIX: Final = "conveyor:join:"
MAX_CHILDREN: Final = 1024
"""The most children one parent may have (a stage asks for at most this many)."""

_MAX_ID = 128
_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True, slots=True)
class Child:
    """Where a child request belongs: its parent, its place, and how many siblings."""

    parent: str
    index: int
    count: int


def child_id(parent: str, index: int) -> str:
    """The request id of ``parent``'s child ``index``: ``<parent>:<index>``, or, when that
    would pass the 128 characters an id may have, the parent's SHA-1 in its place."""
    name = f"{parent}:{index}"
    if len(name) <= _MAX_ID:
        return name
    return f"{hashlib.sha1(parent.encode()).hexdigest()}:{index}"


def join_key(parent: str) -> str:
    """The Redis hash that gathers ``parent``'s children: ``conveyor:join:<parent id>``."""
    return JOIN_PREFIX + parent


def child_of(headers: Sequence[tuple[str, bytes | None]]) -> Child | None:
    """The parent a record's headers name, or None for a plain request.

    All three headers must be there and well formed (an id, ``0 <= index < count <=
    MAX_CHILDREN``); a record that carries only some of them, or bad values, is a
    plain request: it is answered under its own id, as any other.
    """
    for name, _raw in headers:  # plain requests, nearly all of them, leave here
        if name == PARENT_H:
            break
    else:
        return None
    parent = index = count = None
    for name, raw in headers:
        if raw is None or name[:3] != "ce_":
            continue
        if name == PARENT_H:
            parent = raw
        elif name == INDEX_H:
            index = _number(raw)
        elif name == COUNT_H:
            count = _number(raw)
    if parent is None or index is None or count is None:
        return None
    if not 0 <= index < count <= MAX_CHILDREN:
        return None
    try:
        text = parent.decode()
    except UnicodeDecodeError:
        return None
    return Child(text, index, count) if is_valid_request_id(text) else None


def _number(raw: bytes) -> int | None:
    if not raw or len(raw) > 5 or not _DIGITS.issuperset(raw):
        return None
    return int(raw)
