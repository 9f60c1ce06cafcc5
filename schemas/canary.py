"""Canary markers: the records that say which share of a model's requests its canary answers.

A canary is a second consumer group of the model (``<prefix>.<model>.canary``)
reading the same request topics as the primary group (``<prefix>.<model>``).
Every worker of both groups decides for each request, from the request alone,
whether its group answers it:

- the request's **bucket** is a stable hash of its ``ce_stream`` when it has one
  (a stream's frames stay with one version), else of its ``ce_id``:
  ``blake2b(text, digest_size=8)`` read as a big-endian integer, modulo
  ``BUCKETS`` (10,000: a share is exact to a hundredth of a percent);
- the **share** is in basis points (0 to 10,000); the canary answers the requests
  whose bucket is below it, the primary group the others.

The share in effect for a record is set by the last **marker** before it in its
partition: a record of its own in the request topic (key ``MARKER_KEY``, header
``ce_type: conveyor.canary.v1``, value ``{"share": 0.1}``), written to every
partition of every request topic at once by ``conveyor canary``. Both groups read
each partition in the same order, so both see the same share for every record:
no request is answered by both groups or by neither, however the share changes
while requests are in flight, and a redelivered record gets the same decision
again. Before the first marker of a partition the share is 0 (no canary).

A worker that starts on a partition part-way (a restart, a rebalance) must know
the share in effect there without reading the partition from its start: every
commit of a position carries it as the commit's metadata (``commit_note``), so the
position and the share at it are one fact, written together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import orjson

from schemas.headers import ContentType, Header
from schemas.request import OutgoingRecord

__all__ = [
    "BUCKETS",
    "MARKER_KEY",
    "MARKER_TYPE",
    "bucket",
    "canary_marker",
    "commit_note",
    "is_marker",
    "marker_share",
    "read_note",
    "request_bucket",
    "share_points",
]

BUCKETS = 10_000
"""Requests hash to one of this many buckets; a share is a count of them (basis points)."""
MARKER_TYPE = "conveyor.canary.v1"
"""``ce_type`` of a canary marker."""
MARKER_KEY = b"conveyor.canary"
"""The key of every canary marker: one comparison per record finds them."""
_TYPE_HEADER = Header.TYPE.value
_MARKER_TYPE_RAW = MARKER_TYPE.encode()
_NOTE_KEY = "canary_share"


def bucket(key: str | bytes) -> int:
    """The bucket, 0 to ``BUCKETS - 1``, of a request whose ``ce_stream`` (when it has one)
    or else ``ce_id`` is ``key`` (text, or the header's raw UTF-8 bytes)."""
    raw = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def request_bucket(request_id: str, stream: str | None = None) -> int:
    """The bucket of a request: of its stream when it has one, else of its id."""
    return bucket(stream if stream is not None else request_id)


def share_points(share: float) -> int:
    """A share given as a fraction (0.1 for 10%) in basis points; raises ``ValueError``
    outside 0 to 1."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a canary share is from 0 to 1 (0% to 100%), not {share!r}")
    return round(share * BUCKETS)


def canary_marker(share: float, source: str) -> OutgoingRecord:
    """The marker that sets the canary's share to ``share`` (a fraction) from where it lands."""
    points = share_points(share)
    headers = [
        (_TYPE_HEADER, _MARKER_TYPE_RAW),
        (Header.SOURCE.value, source.encode()),
        (Header.CONTENT_TYPE.value, ContentType.JSON.value.encode()),
    ]
    return OutgoingRecord(MARKER_KEY, orjson.dumps({"share": points / BUCKETS}), headers)


def is_marker(key: bytes | None, headers: Sequence[tuple[str, bytes | None]]) -> bool:
    """Whether a record is a canary marker; one with the marker's key but not its type is
    a request like any other."""
    if key != MARKER_KEY:
        return False
    return any(name == _TYPE_HEADER and raw == _MARKER_TYPE_RAW for name, raw in headers)


def marker_share(value: bytes | None) -> int | None:
    """The share (basis points) a marker's value sets; None when it cannot be read (every
    worker then keeps the share it had, the same way)."""
    try:
        document = orjson.loads(value or b"")
        return share_points(float(document["share"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def commit_note(points: int) -> str:
    """The metadata committed with a position: the share in effect there."""
    return orjson.dumps({_NOTE_KEY: points / BUCKETS}).decode()


def read_note(note: str | None) -> int:
    """The share (basis points) a commit's metadata records; 0 when it records none (a
    commit from before any canary, or by another tool)."""
    if not note:
        return 0
    try:
        document = orjson.loads(note)
        return share_points(float(document[_NOTE_KEY]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0
