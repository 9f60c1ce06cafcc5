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
from binascii import crc_hqx
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Final

from schemas.naming import is_valid_request_id, result_key

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


def join_key(parent: str, *, cluster: bool = False) -> str:
    """The Redis hash that gathers ``parent``'s children: ``conveyor:join:<parent id>``.

    On a Redis Cluster (``cluster``): ``conveyor:join:{<tag>}<parent id>``, the hash tag
    chosen so that the join falls in the hash slot of the parent's result key (which has
    no tag: any client finds a result by its id alone). A script may touch keys of one
    slot only, and the joins' scripts touch a parent's join and its result together.
    """
    if not cluster:
        return JOIN_PREFIX + parent
    return f"{JOIN_PREFIX}{{{_slot_tags()[hash_slot(result_key(parent))]}}}{parent}"


_SLOTS = 16384


def hash_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key``: CRC16 of the key, or of its hash tag (the
    text between its first ``{`` and the next ``}``, when not empty), modulo 16384."""
    data = key.encode()
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % _SLOTS


@cache
def _slot_tags() -> tuple[str, ...]:
    """For each hash slot, a short hash tag in it: the first hexadecimal number that
    falls there (about 170,000 tried, once a process)."""
    tags: list[str | None] = [None] * _SLOTS
    missing, n = _SLOTS, 0
    while missing:
        tag = format(n, "x")
        slot = crc_hqx(tag.encode(), 0) % _SLOTS
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(tag for tag in tags if tag is not None)


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
